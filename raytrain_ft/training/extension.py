"""Extending a run past its planned `train.max_steps` on purpose: `extend` (`raytrain-ft extend RUN --max-steps N`).

Whether a run may be extended is the LR schedule's rule (`schedule.extension_refusal`: a `wsd` run whose
decay has not begun); this module records the decision where the next submission's preflight
(`preflight.problems`) and the run's MLflow history read it. Ray-free: the command runs on a laptop.
See docs/extending-runs.md.
"""

from __future__ import annotations

import time

from raytrain_ft.checkpoint.reader import newest_checkpoint
from raytrain_ft.core.errors import CheckpointError
from raytrain_ft.core.recorder import Recorder
from raytrain_ft.core.run_folder import record_extension, step_of
from raytrain_ft.core.schedule import extension_refusal


def extend(run_root: str, max_steps: int, recorder: Recorder) -> dict:
    """Record that the run in `run_root` trains on to `max_steps`: in `<run folder>/extensions.json`
    (what the next submission's preflight checks), as an `extended` event and the `max_steps` tag of
    its MLflow run (`recorder`); the resumed run adds it to its checkpoints' fingerprint history
    (`RunMeta.history`). Returns the record (`run_folder.read_extensions`).

    Raises:
        CheckpointError: no complete checkpoint yet, or the schedule refuses (one line with the reason).
    """
    newest = newest_checkpoint(run_root)
    if newest is None:
        raise CheckpointError(
            f"{run_root} holds no complete checkpoint, so nothing trained is kept: submit it with the new "
            "train.max_steps instead"
        )
    path, saved = newest
    step = step_of(path)
    if reason := extension_refusal(saved.fingerprint, max_steps, step):
        raise CheckpointError(f"cannot extend {run_root} to train.max_steps={max_steps}: {reason}")
    record = {
        "time": time.time(),
        "at_step": step,
        "from_max_steps": saved.fingerprint["train.max_steps"],
        "max_steps": max_steps,
    }
    record_extension(run_root, record)
    recorder.event("extended", **record)
    recorder.tags({"max_steps": str(max_steps)})
    return record
