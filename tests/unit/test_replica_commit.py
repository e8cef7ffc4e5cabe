"""`ReplicaSession.commit` (replica recovery: each replica commits its own saves in
`<run folder>/latest_checkpoint`) never moves the committed checkpoint back: a replica whose save
finished after a newer one was committed leaves the newer one committed and kept. No Ray instance:
the session is built without its Ray Train context (`commit` reads only the run folder)."""

from __future__ import annotations

import os

from raytrain_ft.core.run_folder import METADATA_FILE, complete_steps, read_latest, step_path
from raytrain_ft.launch.worker import ReplicaSession


def session(root: str, keep: int) -> ReplicaSession:
    s = ReplicaSession.__new__(ReplicaSession)  # no Ray Train context: commit needs only these two
    s.run_root, s.keep = root, keep
    return s


def checkpoint(root: str, step: int) -> str:
    path = step_path(root, step)
    os.makedirs(path)
    open(os.path.join(path, METADATA_FILE), "wb").close()  # complete: DCP's metadata is written
    return path


def test_a_late_commit_of_an_older_step_leaves_the_newer_one_committed_and_kept(tmp_path):
    root = str(tmp_path)
    replica = session(root, keep=2)
    step_3, step_6, step_9 = (checkpoint(root, s) for s in (3, 6, 9))
    replica.commit(6, step_6, {})
    replica.commit(3, step_3, {})  # the other replica's save of 3 finished late
    assert read_latest(root) == step_6
    replica.commit(6, step_6, {})  # both replicas commit the same step: no change
    assert read_latest(root) == step_6
    assert complete_steps(root) == [3, 6, 9]  # the late commit pruned nothing
    replica.commit(9, step_9, {})
    assert read_latest(root) == step_9
    assert complete_steps(root) == [6, 9]  # keep 2: 6 and 9 stay
