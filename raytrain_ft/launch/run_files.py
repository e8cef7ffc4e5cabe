"""Small files in the run folder that the driver, the workers and chaos tooling exchange.

Kept apart from `worker.py` and `callbacks.py` so that reading or writing them imports neither the
training loop nor MLflow (a plain Ray Train loop in `benchmarks/goodput.py` writes worker records too).
"""

from __future__ import annotations

import json
import os
import time

import fsspec

COMMIT_ACK_FILE = "last_commit_ack"


def _record_path(run_root: str, rank: int) -> str:
    return f"{run_root.rstrip('/')}/workers/rank{rank}.json"


def write_worker_record(run_root: str, rank: int) -> None:
    """Write `<run folder>/workers/rank<r>.json` (this process's pid, node IP, start time in unix
    seconds), once per attempt: which process to `py-spy dump` when a rank misbehaves, and which one
    a chaos test or `benchmarks/goodput.py` kills."""
    import ray  # the run folder's other files are read without Ray (`raytrain-ft check`)

    record = {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(), "started_at": time.time()}
    with fsspec.open(_record_path(run_root, rank), "w", auto_mkdir=True) as f:
        json.dump(record, f)


def worker_records(run_root: str, world_size: int, since: float) -> dict[int, dict] | None:
    """{rank: record} of the attempt whose `world_size` workers all started after unix time `since`,
    once each wrote its record (`write_worker_record`); None until then."""
    records = {}
    for rank in range(world_size):
        try:
            with fsspec.open(_record_path(run_root, rank), "r") as f:
                record = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or being written
            return None
        if record["started_at"] <= since:
            return None
        records[rank] = record
    return records


def _ack_path(run_root: str) -> str:
    return f"{run_root.rstrip('/')}/{COMMIT_ACK_FILE}"


def write_commit_ack(run_root: str, checkpoint_path: str) -> None:
    """Record `checkpoint_path` as the commit Ray last registered (`<run folder>/last_commit_ack`)."""
    with fsspec.open(_ack_path(run_root), "w") as f:
        f.write(checkpoint_path)


def read_commit_ack(run_root: str) -> str | None:
    """The path `write_commit_ack` last wrote; None before the first, or while it is being replaced."""
    try:
        with fsspec.open(_ack_path(run_root), "r") as f:
            return f.read()
    except OSError:  # not written yet, or (object stores: s3fs FileExpired) replaced while being read
        return None


LATEST_CHECKPOINT_FILE = "latest_checkpoint"


def write_latest_checkpoint(run_root: str, checkpoint_path: str) -> None:
    """Commit `checkpoint_path` without Ray Train (`<run folder>/latest_checkpoint`; a run without
    torchrun's or replica recovery's Ray reports): written to a temporary file and renamed, so it
    always names a complete checkpoint."""
    fs, base = fsspec.core.url_to_fs(run_root)
    fs.makedirs(base, exist_ok=True)
    path = f"{base.rstrip('/')}/{LATEST_CHECKPOINT_FILE}"
    with fs.open(f"{path}.tmp", "w") as f:
        f.write(checkpoint_path)
    fs.mv(f"{path}.tmp", path)


def read_latest_checkpoint(run_root: str) -> str | None:
    """The checkpoint `write_latest_checkpoint` last committed; None before the first."""
    fs, base = fsspec.core.url_to_fs(run_root)
    path = f"{base.rstrip('/')}/{LATEST_CHECKPOINT_FILE}"
    return fs.cat_file(path).decode() if fs.exists(path) else None


EXTENSIONS_FILE = "extensions.json"


def _extensions_path(run_root: str) -> str:
    return f"{run_root.rstrip('/')}/{EXTENSIONS_FILE}"


def read_extensions(run_root: str) -> list[dict]:
    """The run's extensions (`raytrain-ft extend`), oldest first: `{"time" (unix s), "at_step",
    "from_max_steps", "max_steps"}` each; [] for a run never extended."""
    try:
        with fsspec.open(_extensions_path(run_root), "r") as f:
            return json.load(f)
    except FileNotFoundError:
        return []


def record_extension(run_root: str, record: dict) -> None:
    """Append `record` to `<run folder>/extensions.json` (written whole: one writer, the `extend` command)."""
    records = read_extensions(run_root) + [record]
    with fsspec.open(_extensions_path(run_root), "w") as f:
        json.dump(records, f, indent=1)
