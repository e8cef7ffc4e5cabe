"""Two gloo ranks (torch only, no Ray): one rank's checkpoint write fails after the other finished its own.

Run by tests/test_commit_gating.py in a subprocess. Usage: python commit_gating.py OUT

Each rank builds a `Checkpointer` on OUT/run with the loop's commit protocol: `save`, then `poll`
once per "step" (as `loop.Trainer.step` does) until the save commits or fails. The commit callback
records the step, and rank 0 writes the committed path to OUT/run/latest (as `LocalSession.commit`).

1. Step 5 saves and commits on both ranks.
2. Step 10: rank 0 writes at once; rank 1's writer first sleeps 1 s (`SlowWriter`, the
   `slow_save` fault's writer) and then fails for real: its soft `RLIMIT_FSIZE` is 4 KiB, below its
   16 KiB shard, so the kernel refuses the write with EFBIG (SIGXFSZ ignored), which torch's writer
   reports as a short write ("unexpected pos").
3. "Restart": each rank builds a fresh state and `restore_latest` loads what the session names.

OUT/result.json: per rank, the steps committed, the error type of the failed save (or null), when
rank 0's own file of step 10 was complete relative to the failure (seconds), the step restored and
whether the restored tensors equal the ones saved at step 5.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from raytrain_ft.checkpoint.checkpointer import Checkpointer
from raytrain_ft.checkpoint.restore import restore_latest
from raytrain_ft.checkpoint.train_state import KEY_META, KEY_MODEL, ModelState, RunMeta, TrainState
from raytrain_ft.core.recorder import NullRecorder
from raytrain_ft.core.run_folder import step_path
from raytrain_ft.resilience.storage_faults import SlowWriter

WORLD_SIZE = 2
FSIZE_LIMIT = 4096  # bytes: below each rank's own 64x64 float32 weight (16 KiB in its DCP file)


def latest_checkpoint(run_root: str) -> str | None:
    """The committed path, as the session would give it."""
    path = os.path.join(run_root, "latest")
    return open(path).read() if os.path.exists(path) else None


def make_state(rank: int, seed: int) -> TrainState:
    torch.manual_seed(seed)
    state = TrainState(rank)
    state.add(KEY_META, RunMeta({"model": "test"}))
    state.add(KEY_MODEL, ModelState(torch.nn.Linear(8, 8)))  # replicated (same seed): DCP writes it once
    torch.manual_seed(seed + 1 + rank)
    state.add(f"rank{rank}", ModelState(torch.nn.Linear(64, 64, bias=False)))  # each rank writes its own
    return state


def tensors(state: TrainState) -> dict[str, torch.Tensor]:
    return {
        f"{k}.{n}": t.clone() for k, c in state.components.items() if k != KEY_META for n, t in c.state_dict().items()
    }


def save_and_poll(
    ckpt: Checkpointer, step: int, state: TrainState, delay_s: float, commit: Callable[[int], None]
) -> tuple[str | None, float]:
    """Save `step` and poll until it is complete, then `commit` it; return (`Type: message` if it
    failed, when it ended)."""
    ckpt.save(step, state, lambda path: SlowWriter(path, delay_s))
    while True:
        try:
            if (complete := ckpt.poll()) is not None:
                commit(complete)
                return None, time.time()
        except BaseException as e:  # DCP's CheckpointException is a BaseException
            return f"{type(e).__name__}: {e}", time.time()
        time.sleep(0.05)


def worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD_SIZE)
    root = os.path.join(out, "run")
    committed: list[int] = []

    def commit(step: int) -> None:
        committed.append(step)
        if rank == 0:
            with open(os.path.join(root, "latest.tmp"), "w") as f:
                f.write(step_path(root, step))
            os.replace(os.path.join(root, "latest.tmp"), os.path.join(root, "latest"))

    state = make_state(rank, seed=0)
    ckpt = Checkpointer(root)
    first_error, _ = save_and_poll(ckpt, 5, state, 0.0, commit)
    saved_at_5 = tensors(state)
    with torch.no_grad():  # training goes on: the state of step 10 differs
        for c in state.components.values():
            if isinstance(c, ModelState):
                for p in c.model.parameters():
                    p.add_(1.0)
    if rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (FSIZE_LIMIT, hard))
    error, ended = save_and_poll(ckpt, 10, state, 1.0 if rank == 1 else 0.0, commit)
    if rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    own_file = os.path.join(root, "step-10", f"__{rank}_0.distcp")
    own_done = os.path.getmtime(own_file) - ended if os.path.exists(own_file) else None
    dist.barrier()

    restored = make_state(rank, seed=100)  # a restarted rank: other weights until the load
    loaded, _, _ = restore_latest(Checkpointer(root), restored, root, latest_checkpoint(root), NullRecorder())
    result = {
        "first_error": first_error,
        "committed": committed,
        "error": error,
        "own_file_written_s_before_failure": None if own_done is None else -own_done,
        "restored_step": loaded,
        "tensors_restored": sorted(tensors(restored)),
        "tensors_equal_to_step_5": sorted(k for k, v in tensors(restored).items() if torch.equal(v, saved_at_5[k])),
        "step_10_left": os.path.exists(os.path.join(root, "step-10")),
    }
    rows: list = [None] * WORLD_SIZE
    dist.all_gather_object(rows, result)
    if rank == 0:
        with open(os.path.join(out, "result.json"), "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def main() -> None:
    out = sys.argv[1]
    os.makedirs(os.path.join(out, "run"), exist_ok=True)
    store = os.path.join(tempfile.mkdtemp(), "store")
    # forkserver: a rank ends with os._exit, skipping the interpreter's finalization, where a spawned
    # rank aborted about one run in eight ("terminate called without an active exception").
    mp.start_processes(worker, args=(store, out), nprocs=WORLD_SIZE, start_method="forkserver")


if __name__ == "__main__":
    main()
