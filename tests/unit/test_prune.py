"""`checkpoint.prune`: retention for commits made without Ray Train (replica recovery)."""

from raytrain_ft.checkpoint.checkpointer import list_step_dirs, prune, step_path


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
