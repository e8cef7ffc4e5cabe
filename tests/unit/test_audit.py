"""The data audit's files: a rank killed mid-write leaves no torn file that `read_audit` reads."""

import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from raytrain_ft.core.run_folder import AUDIT_DIR
from raytrain_ft.data.audit import DataAudit, read_audit
from raytrain_ft.data.position import BatchPlan, Share
from raytrain_ft.resilience.whole_group import WholeGroup


def test_a_write_cut_by_a_kill_is_ignored_and_the_committed_steps_are_read(tmp_path, process_group):
    audit = DataAudit(str(tmp_path), WholeGroup(Share(BatchPlan(4, 2, 1), 0), dist.group.WORLD).gather, True, 3)
    audit.record(1, torch.tensor([7, 3]))
    audit.record(2, torch.tensor([5, 1]))  # a share shorter than `width`: padded, not written
    audit.flush()
    # what a kill mid-write leaves (the elastic test once met a 0-byte file): the next commit's
    # file cut short under its temporary name, steps 3-4 that never committed
    (tmp_path / AUDIT_DIR / f"{2**62}-3-4.parquet.partial").write_bytes(b"PAR1")
    table = read_audit(str(tmp_path))
    assert table.to_pydict() == {"step": [1, 1, 2, 2], "rank": [0, 0, 0, 0], "sample_id": [7, 3, 5, 1]}
    (written,) = (tmp_path / AUDIT_DIR).glob("*-1-2.parquet")
    assert pq.read_table(written).equals(table)  # the committed file was renamed into place whole


def test_a_step_recorded_again_replaces_its_record_and_the_later_ones(tmp_path, process_group):
    """A step that did not commit (replica recovery) is trained again: only its last record is written."""
    audit = DataAudit(str(tmp_path), WholeGroup(Share(BatchPlan(4, 2, 1), 0), dist.group.WORLD).gather, True, 2)
    audit.record(1, torch.tensor([7, 3]))
    audit.record(2, torch.tensor([5, 1]))  # not committed ...
    audit.record(2, torch.tensor([5, 1]))  # ... and trained again
    audit.record(3, torch.tensor([4, 0]))
    audit.flush()
    assert read_audit(str(tmp_path)).to_pydict()["step"] == [1, 1, 2, 2, 3, 3]
