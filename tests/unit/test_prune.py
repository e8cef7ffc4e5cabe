"""`checkpoint.prune`: retention for commits made without Ray Train (replica recovery); `checkpoint.cleanup`:
the folders of saves that never committed, deleted at the restore (proven by the folders, not an event)."""

from raytrain_ft.checkpoint.checkpointer import cleanup, list_step_dirs, prune, step_path


def test_prune_keeps_the_newest_complete_checkpoints_and_drops_older_partial_ones(tmp_path):
    root = str(tmp_path)
    for step in range(1, 8):
        path = tmp_path / f"step-{step}"
        path.mkdir()
        if step != 3:  # step 3: a save cut by a kill, never complete
            (path / ".metadata").write_bytes(b"x")
    assert prune(root, 6, keep=3) == [1, 2, 3]
    # kept: the committed step 6, the two complete ones before it, and step 7 (newer: not this commit's to judge)
    assert list_step_dirs(root) == {4: True, 5: True, 6: True, 7: True}
    assert prune(step_path(root, 0).rsplit("/", 1)[0], 7, keep=1) == [4, 5, 6]


def test_cleanup_deletes_every_folder_newer_than_the_commit_or_incomplete_and_keeps_the_rest(tmp_path):
    root = str(tmp_path)
    for step, complete in ((3, False), (5, True), (8, True), (10, True), (12, False)):
        path = tmp_path / f"step-{step}"
        (path / "sub").mkdir(parents=True)
        (path / "sub" / "0_0.distcp").write_bytes(b"shard")  # what a cut save leaves: shards, maybe no metadata
        if complete:
            (path / ".metadata").write_bytes(b"x")
    # committed: 8. 10 completed after the last commit (its report never registered), 12 was cut, 3 never finished
    assert cleanup(root, 8) == [3, 10, 12]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-5", "step-8"]
    assert (tmp_path / "step-8" / "sub" / "0_0.distcp").read_bytes() == b"shard"  # the committed one is whole
