"""The run folder `<run.storage_path>/<run.name>/`: the name of every file and folder a run writes
there, and the helpers that read and write them. No other module spells a path in it.

    step-<N>/                         a checkpoint (DCP); complete once `.metadata` is written
      .metadata, .checksums           DCP's metadata (written last, by the coordinator); the checksums
                                      of every stored byte (`raytrain_ft.checkpoint.integrity`)
    checkpoint_manager_snapshot.json  Ray Train's record of the committed checkpoints
    latest_checkpoint                 the committed checkpoint of a run without Ray (`LocalSession`)
    last_commit_ack                   the checkpoint Ray last registered (controller callback -> workers)
    mlflow_run_id                     the run's MLflow run, across restarts and resubmissions
    extensions.json                   `raytrain-ft extend` records (the next submission's preflight checks them)
    run_ended_by_error                a worker's message for an error no restart cures (a full disk)
    workers/rank<R>.json              each worker's pid, node IP and start time, per attempt
    workers/replica<R>.final.json     a replica's final state digest (`failure.recovery: replica`)
    hangs/step<N>-<unix s>.txt        every worker's stacks when ranks stalled after step N (the progress watchdog;
                                      `start-<unix s>.txt` before the first step of a start)
    faults/<index>-<step>.fired       fault-injection markers: a fault fires once per run
    audit/<ns>-<first>-<last>.parquet the sample ids every rank trained (`raytrain_ft.data.audit`)
    exclusions/<node>-step<N>.json    a straggler excluded after step N (`straggler.action: exclude`): the
                                      driver restarts without its node (`launch.driver`)

Paths are local paths or fsspec URLs (`s3://...`). Reading this module imports neither Ray, torch
nor MLflow (`raytrain-ft check` and the driver read the run folder before any worker exists).
"""

from __future__ import annotations

import json
import os
import time

import fsspec

from raytrain_ft.core.errors import StorageFullError

STEP_PREFIX = "step-"
METADATA_FILE = ".metadata"  # DCP's; its coordinator writes it after every rank's data
CHECKSUM_FILE = ".checksums"
RAY_RUN_STATE = "checkpoint_manager_snapshot.json"
LATEST_FILE = "latest_checkpoint"
COMMIT_ACK_FILE = "last_commit_ack"
RUN_ID_FILE = "mlflow_run_id"
EXTENSIONS_FILE = "extensions.json"
RUN_ENDED_FILE = "run_ended_by_error"
WORKERS_DIR = "workers"
HANGS_DIR = "hangs"
FAULTS_DIR = "faults"
AUDIT_DIR = "audit"
EXCLUSIONS_DIR = "exclusions"


def run_root(storage_path: str, run_name: str) -> str:
    """The run folder of `run.name` under `run.storage_path`."""
    return f"{storage_path.rstrip('/')}/{run_name}"


def run_file(root: str, *names: str) -> str:
    """`<root>/<names...>`: a file or folder in the run folder `root` (one of this module's names)."""
    return "/".join([root.rstrip("/"), *names])


# ---- checkpoints


def step_path(root: str, step: int) -> str:
    """The checkpoint folder of `step`: `<root>/step-<step>`."""
    return run_file(root, f"{STEP_PREFIX}{step}")


def step_of(checkpoint: str) -> int:
    """The step of a checkpoint folder `.../step-<N>`."""
    return int(checkpoint.rstrip("/").rsplit("/", 1)[-1][len(STEP_PREFIX) :])


def list_step_dirs(root: str) -> dict[int, bool]:
    """{step: complete} for every `step-N` folder under `root` (complete = has DCP metadata)."""
    fs, base = fsspec.core.url_to_fs(root)
    if not fs.exists(base):
        return {}
    out = {}
    for p in fs.ls(base, detail=False):
        name = p.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith(STEP_PREFIX) and name[len(STEP_PREFIX) :].isdigit():
            out[int(name[len(STEP_PREFIX) :])] = fs.exists(f"{p}/{METADATA_FILE}")
    return out


def complete_steps(root: str) -> list[int]:
    """Steps of the complete checkpoints under `root` (every rank's write finished), oldest first;
    committed or not (`committed_steps`)."""
    return sorted(s for s, done in list_step_dirs(root).items() if done)


def has_run_state(root: str) -> bool:
    """Whether Ray Train's record of the committed checkpoints (`RAY_RUN_STATE`) exists."""
    fs, base = fsspec.core.url_to_fs(run_file(root, RAY_RUN_STATE))
    return fs.exists(base)


def committed_steps(root: str) -> list[int]:
    """Steps of the committed checkpoints under `root`, oldest first: the complete ones Ray Train's
    run state lists (`RAY_RUN_STATE`, its `checkpoint_results`), or every complete one of a run
    without it (`raytrain_ft.training.local_session`)."""
    complete = complete_steps(root)
    if not has_run_state(root):
        return complete
    fs, base = fsspec.core.url_to_fs(run_file(root, RAY_RUN_STATE))
    names = {r["checkpoint_dir_name"] for r in json.loads(fs.cat_file(base))["checkpoint_results"]}
    return [s for s in complete if f"{STEP_PREFIX}{s}" in names]


def _replace(root: str, name: str, text: str) -> None:
    """Write `text` into the run file `name` through a temporary file renamed over it: a reader sees
    the old text or the new one, never a truncated file."""
    fs, base = fsspec.core.url_to_fs(run_file(root, name))
    fs.makedirs(base.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(f"{base}.tmp", "w") as f:
        f.write(text)
    fs.mv(f"{base}.tmp", base)


def write_latest(root: str, checkpoint: str) -> None:
    """Record `checkpoint` as committed (`LATEST_FILE`, replaced whole)."""
    _replace(root, LATEST_FILE, checkpoint)


def read_latest(root: str) -> str | None:
    """The checkpoint `write_latest` last recorded; None before the first."""
    fs, base = fsspec.core.url_to_fs(run_file(root, LATEST_FILE))
    return fs.cat_file(base).decode() if fs.exists(base) else None


def write_commit_ack(root: str, checkpoint: str) -> None:
    """Record `checkpoint` as the commit Ray last registered (`COMMIT_ACK_FILE`, replaced whole)."""
    _replace(root, COMMIT_ACK_FILE, checkpoint)


def read_commit_ack(root: str) -> str | None:
    """The path `write_commit_ack` last wrote; None before the first, or (object stores) while it is replaced."""
    try:
        with fsspec.open(run_file(root, COMMIT_ACK_FILE), "r") as f:
            return f.read()
    except OSError:  # not written yet, or (object stores: s3fs FileExpired) replaced while being read
        return None


# ---- the run's identity and life


def read_run_id(root: str) -> str | None:
    """The MLflow run id recorded in `RUN_ID_FILE`; None before the first submission."""
    fs, base = fsspec.core.url_to_fs(run_file(root, RUN_ID_FILE))
    return fs.cat_file(base).decode().strip() if fs.exists(base) else None


def write_run_id(root: str, run_id: str) -> None:
    """Record the run's MLflow run id (`RUN_ID_FILE`), creating the run folder."""
    fs, base = fsspec.core.url_to_fs(root)
    fs.makedirs(base, exist_ok=True)
    with fs.open(run_file(base, RUN_ID_FILE), "w") as f:
        f.write(run_id)


def read_extensions(root: str) -> list[dict]:
    """The run's extensions (`raytrain-ft extend`), oldest first: `{"time" (unix s), "at_step",
    "from_max_steps", "max_steps"}` each; [] for a run never extended."""
    try:
        with fsspec.open(run_file(root, EXTENSIONS_FILE), "r") as f:
            return json.load(f)
    except FileNotFoundError:
        return []


def record_extension(root: str, record: dict) -> None:
    """Append `record` to `EXTENSIONS_FILE` (written whole: one writer, the `extend` command)."""
    records = read_extensions(root) + [record]
    with fsspec.open(run_file(root, EXTENSIONS_FILE), "w") as f:
        json.dump(records, f, indent=1)


def end_run(root: str, message: str) -> None:
    """Stop training without a restart (rank 0, the others just return): leave `message` in
    `RUN_ENDED_FILE` for the driver, which reports it as the run's error (`raise_if_ended`)."""
    with fsspec.open(run_file(root, RUN_ENDED_FILE), "w") as f:
        f.write(message)


def raise_if_ended(root: str) -> None:
    """Driver, after the workers returned: raise the error a worker ended the run with, if any
    (and remove its file, so a resubmission starts clean).

    Raises:
        StorageFullError: the message `end_run` left.
    """
    fs, base = fsspec.core.url_to_fs(run_file(root, RUN_ENDED_FILE))
    if fs.exists(base):
        message = fs.cat_file(base).decode()
        fs.rm(base)
        raise StorageFullError(message)


# ---- per-rank records


def _worker_record(root: str, rank: int) -> str:
    return run_file(root, WORKERS_DIR, f"rank{rank}.json")


def replica_final_file(root: str, replica: int) -> str:
    """`workers/replica<R>.final.json`: replica R's step, state digest and skip count at its end
    (`raytrain_ft.resilience.replicas.Replicas.finish`)."""
    return run_file(root, WORKERS_DIR, f"replica{replica}.final.json")


def write_worker_record(root: str, rank: int, node_ip: str, node_id: str) -> None:
    """Write `workers/rank<r>.json` (this process's pid, `node_ip` and Ray `node_id`, start time in unix
    seconds), once per attempt: which process to `py-spy dump` when a rank misbehaves, and which one a
    chaos test or `benchmarks/goodput.py` kills."""
    record = {"pid": os.getpid(), "node_ip": node_ip, "node_id": node_id, "started_at": time.time()}
    with fsspec.open(_worker_record(root, rank), "w", auto_mkdir=True) as f:
        json.dump(record, f)


def worker_records(root: str, world_size: int, since: float) -> dict[int, dict] | None:
    """{rank: record} of the attempt whose `world_size` workers all started after unix time `since`,
    once each wrote its record (`write_worker_record`); None until then."""
    records = {}
    for rank in range(world_size):
        try:
            with fsspec.open(_worker_record(root, rank), "r") as f:
                record = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or being written
            return None
        if record["started_at"] <= since:
            return None
        records[rank] = record
    return records


def stacks_path(root: str, step: int | None, at: float) -> str:
    """Where the progress watchdog writes every worker's stacks (`raytrain_ft.launch.progress_watchdog`)
    when ranks stalled after `step` (None: before the first step of their start) at unix time `at`:
    `hangs/step<N>-<unix s>.txt` (`hangs/start-<unix s>.txt`)."""
    return run_file(root, HANGS_DIR, f"{'start' if step is None else f'step{step}'}-{int(at)}.txt")


def fault_marker(root: str, index: int, step: int) -> str:
    """The marker of fault `index` fired at `step`: `faults/<index>-<step>.fired`."""
    return run_file(root, FAULTS_DIR, f"{index}-{step}.fired")


# ---- straggler exclusions


def _exclusion_file(root: str, node: str, step: int) -> str:
    return run_file(root, EXCLUSIONS_DIR, f"{node}-step{step}.json")


def record_exclusion(root: str, record: dict) -> None:
    """Write `exclusions/<node>-step<N>.json`: `{"time" (unix s), "node" (Ray node id), "rank", "step"}`
    of a straggler excluded after step N (`raytrain_ft.resilience.straggler.StragglerMonitor`; one
    writer per file, the excluded worker)."""
    with fsspec.open(_exclusion_file(root, record["node"], record["step"]), "w", auto_mkdir=True) as f:
        json.dump(record, f)


def read_exclusions(root: str, since: float) -> list[dict]:
    """The exclusions recorded after unix time `since` (`record_exclusion`), oldest first."""
    fs, base = fsspec.core.url_to_fs(run_file(root, EXCLUSIONS_DIR))
    records = []
    for path in fs.glob(f"{base}/*.json") if fs.exists(base) else []:
        with fs.open(path, "r") as f:
            records.append(json.load(f))
    return sorted((r for r in records if r["time"] > since), key=lambda r: r["time"])
