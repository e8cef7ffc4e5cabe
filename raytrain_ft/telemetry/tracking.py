"""MLflow tracking: one MLflow run per training run, across restarts and resubmissions.

The driver creates the run (or reuses the id stored in `<run folder>/mlflow_run_id`) and logs the
config as params; `MlflowRecorder` records into it (`raytrain_ft.core.recorder`; step metrics with
`MlflowClient.log_batch` in the background, `raytrain_ft.telemetry.timeline`: one value per step on the kept
timeline; nothing calls `mlflow.start_run`, whose exit would mark the run finished) for rank 0
and the Ray Train controller callback (through the job's `RecorderActor`); the driver sets the
final status. Default store: `sqlite:///$HOME/raytrain-ft/mlflow.db`
(`DEFAULT_STORE_DIR`; MLflow 3 refuses the plain file store), the same for the driver however it was
started and for `raytrain-ft history`; view it with
`mlflow ui --backend-store-uri sqlite:///$HOME/raytrain-ft/mlflow.db --host 127.0.0.1`.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from raytrain_ft.core.errors import UserError
from raytrain_ft.core.recorder import Recorder
from raytrain_ft.core.run_folder import RUN_ID_FILE, raise_if_ended, read_run_id, run_file, write_run_id
from raytrain_ft.resilience import recovery
from raytrain_ft.resilience.recovery import RunHistory
from raytrain_ft.telemetry.outbox import Outbox
from raytrain_ft.telemetry.timeline import DISCARDED, KEPT, StepTimeline

EVENTS_DIR = "events"
GOODPUT_SUMMARY = "goodput_summary.json"
PLOT_MIN_PERIOD_S = 30.0
log = logging.getLogger(__name__)


# MLflow's artifact download progress bars would print at every attempt start (events) and in
# `raytrain-ft history`; every process that logs imports this module.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}  # MLflow 3 UI: training, not GenAI


# The default store's folder. Not the current folder: under `ray job submit --working-dir .` the driver
# runs in Ray's temporary copy of it, which Ray deletes, and `raytrain-ft history` runs elsewhere.
DEFAULT_STORE_DIR = os.path.join("~", "raytrain-ft")


def resolve_uri(uri: str) -> str:
    """The tracking URI to use everywhere, driver and `raytrain-ft history` alike: `uri`, else
    `MLFLOW_TRACKING_URI` (MLflow's standard variable), else `sqlite:///$HOME/raytrain-ft/mlflow.db`
    (absolute: Ray workers run in other folders). Creates nothing."""
    default = f"sqlite:///{os.path.join(os.path.expanduser(DEFAULT_STORE_DIR), 'mlflow.db')}"
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or default


def steps_logged_since(client: MlflowClient, run_id: str, since: float) -> list[tuple[int, float]]:
    """(step, unix seconds) of the steps rank 0 completed after unix time `since` (the `last_step`
    metric it logs as each step ends, millisecond timestamps); what a chaos test or a benchmark polls."""
    return [
        (int(m.value), m.timestamp / 1000)
        for m in client.get_metric_history(run_id, "last_step")
        if m.timestamp / 1000 > since
    ]


def start_or_resume_run(uri: str, experiment: str, run_root: str, run_name: str, params: dict) -> str:
    """Return the MLflow run id of this training run, creating the run on first submission."""
    client = MlflowClient(uri)
    run_id = read_run_id(run_root)
    if run_id is not None:
        try:
            client.update_run(run_id, status="RUNNING")
        except MlflowException:
            raise UserError(
                f"{run_file(run_root, RUN_ID_FILE)} names MLflow run {run_id}, which {uri} does not have; set "
                "tracking.uri to the store this run logged to (on a cluster: an MLflow server every node reaches)"
            ) from None
        return run_id
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment, _artifact_root(uri), EXPERIMENT_KIND)
    run_id = client.create_run(exp_id, run_name=run_name).info.run_id
    client.log_batch(run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])
    write_run_id(run_root, run_id)
    return run_id


def finish_run(recorder: MlflowRecorder, run_root: str, failed: bool) -> None:
    """End `recorder`'s MLflow run after its launcher's last attempt: FAILED when that attempt failed
    (`failed`) or a worker ended the run with an error no restart cures (`run_folder.end_run`: a full
    disk), FINISHED otherwise. The one owner of a run's end status, for the Ray driver
    (`launch.driver`) and the Ray-free runner (`tests/local_run.py`) alike; a run stopped by SIGTERM
    is the driver's own (KILLED).

    Raises:
        StorageFullError: the error a worker ended the run with (`run_folder.raise_if_ended`), once
            the run is FAILED.
    """
    if failed:
        recorder.finish("FAILED")
        return
    try:
        raise_if_ended(run_root)
    except UserError:
        recorder.finish("FAILED")
        raise
    recorder.finish("FINISHED")


def _artifact_root(uri: str) -> str | None:
    """Artifacts beside a sqlite store, as an absolute path (Ray workers run in other folders)."""
    if uri.startswith("sqlite:///"):
        return os.path.join(os.path.dirname(uri[len("sqlite:///") :]), "mlartifacts")
    return None


def flatten(d: dict, prefix: str = "") -> dict:
    """{"train": {"lr": 1}} -> {"train.lr": 1} (MLflow params are flat)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


class MlflowRecorder(Recorder):
    """The `Recorder` of an existing MLflow run, by id (safe from Ray actors and the controller;
    the training workers record through a `RemoteRecorder` instead). Beyond the interface: what the
    driver, the CLI and the tests read back (`events`, `latest_metrics`, `load_history`) and the
    run's end (`finish`).

    Every write goes through `outbox` (`Outbox`: in order, in the background, held while the store
    is unreachable); reads (`events`, `latest_metrics`, ...) go to the store.

    `history`: the run's `RunHistory` that `event` keeps up to date (None: none kept).
    `outbox`: shared by the recorders of one process's attempts (a new one if None).
    `timeout_s`: how long `hang` and `registered` wait for the store (`waits.tracking_timeout_s`).
    """

    def __init__(
        self,
        uri: str,
        run_id: str,
        history: RunHistory | None = None,
        outbox: Outbox | None = None,
        timeout_s: float = 30.0,
    ):
        self.client, self.run_id, self.history = MlflowClient(uri), run_id, history
        self.outbox, self.timeout_s = outbox or Outbox(), timeout_s
        if self.outbox.on_outage is None:
            self.outbox.on_outage = lambda held, seconds: self.event("tracking_outage", held=held, seconds=seconds)
        self.timeline = StepTimeline(self.client, run_id, self.outbox)  # rank 0's per-step metrics
        self._plotter: ThreadPoolExecutor | None = None
        self._plot: Future | None = None
        self._plotted = -PLOT_MIN_PERIOD_S

    def run_start(self) -> float:
        """When the MLflow run was created (first submission), unix seconds."""
        return self.client.get_run(self.run_id).info.start_time / 1000.0

    def load_history(self) -> RunHistory:
        """The run's `RunHistory` as the store holds it (when it was created, its events)."""
        return RunHistory.of(self.run_start(), self.events())

    def metrics(self, step: int, values: dict[str, float]) -> None:
        ts = int(time.time() * 1000)
        batch = [Metric(k, float(v), ts, step) for k, v in values.items()]
        self.outbox.put(lambda: self.client.log_batch(self.run_id, metrics=batch))

    def tags(self, values: dict[str, str]) -> None:
        batch = [RunTag(k, str(v)[:5000]) for k, v in values.items()]
        self.outbox.put(lambda: self.client.log_batch(self.run_id, tags=batch))

    def latest_metrics(self) -> dict[str, float]:
        """Each metric's latest value ({key: value})."""
        return self.client.get_run(self.run_id).data.metrics

    def event(self, kind: str, **fields: object) -> None:
        """Each event is its own artifact `events/<time>-<id>.json`: writers on several ranks and the
        controller never overwrite each other."""
        event = {"time": time.time(), "kind": kind, **fields}
        if self.history is not None:
            self.history.record(event)
        name = f"{EVENTS_DIR}/{time.time_ns()}-{uuid.uuid4().hex[:8]}.json"
        self.outbox.put(lambda: self.client.log_dict(self.run_id, event, name))

    def events(self) -> list[dict]:
        """Every event of the run, oldest first."""
        if not self.client.list_artifacts(self.run_id, EVENTS_DIR):
            return []
        folder = self.client.download_artifacts(self.run_id, EVENTS_DIR)
        events = []
        for name in os.listdir(folder):
            if name.endswith(".json") and not name.startswith("."):  # not an upload in progress
                with open(os.path.join(folder, name)) as f:
                    events.append(json.load(f))
        return sorted(events, key=lambda e: e["time"])

    def hang(self, ranks: list[int], step: int | None, dump: str, stalled_s: float) -> None:
        # an MLflow artifact, beside the run folder's copy (`run_folder.stacks_path`)
        name = f"hangs/{'start' if step is None else f'step{step}'}-{int(time.time())}.txt"
        self.outbox.put(lambda: self.client.log_text(self.run_id, dump, name))
        self.event("hang", ranks=ranks, step=step, stack_dump=name, stalled_s=stalled_s)
        self.outbox.drain(self.timeout_s)

    def record_step(self, step: int, values: dict[str, float], current: dict[str, float], at: float) -> None:
        self.timeline.record(step, values, current, at)

    def committed(self, step: int) -> None:
        self.timeline.committed(step)

    def registered(self) -> None:
        self.timeline.registered()
        self.outbox.drain(self.timeout_s)

    def discard_after(self, step: int) -> None:
        self.timeline.discard_after(step)

    def resume_timeline(self, resumed_from: int, attempt_starts: list[float]) -> None:
        self.timeline.recover(resumed_from, attempt_starts)

    def drain(self, timeout_s: float | None = None) -> bool:
        """At the end of a run: wait until every record so far reached the store, at most
        `timeout_s` seconds (None: `timeout_s` of the recorder), the store reachable or not; True if none is left."""
        return self.outbox.drain(self.timeout_s if timeout_s is None else timeout_s, while_down=True)

    def goodput(self, step: int, summary: dict[str, float], final: bool = False) -> None:
        """The final summary also goes to the artifact `goodput_summary.json`."""
        self.metrics(step, summary)
        if final:
            self.outbox.put(lambda: self.client.log_dict(self.run_id, summary, GOODPUT_SUMMARY))

    def refresh_loss_plot(self, wait: bool = False) -> None:
        """Re-render `loss.png` (`raytrain_ft.telemetry.plots`) in a background thread, off the training
        loop. Skipped while the previous render runs or if one started less than
        `PLOT_MIN_PERIOD_S` ago (a render reads the whole loss history: with checkpoints every few
        seconds it would compete with training for rank 0's CPU). `wait` renders now and blocks."""
        if not wait and (
            (self._plot is not None and not self._plot.done()) or time.monotonic() - self._plotted < PLOT_MIN_PERIOD_S
        ):
            return
        if self._plot is not None:
            self._plot.result()
        self._plotted = time.monotonic()
        self._plotter = self._plotter or ThreadPoolExecutor(max_workers=1, thread_name_prefix="loss-plot")
        self._plot = self._plotter.submit(self._render_loss_plot)
        if wait:
            self._plot.result()

    def _render_loss_plot(self) -> None:
        from raytrain_ft.telemetry.plots import LOSS_PLOT, loss_figure

        try:
            kept, discarded = (
                self.client.get_metric_history(self.run_id, k) for k in (KEPT + "loss", DISCARDED + "loss")
            )
            fig = loss_figure([(m.step, m.value) for m in kept], [(m.step, m.value) for m in discarded], self.events())
            self.client.log_figure(self.run_id, fig, LOSS_PLOT)
        except Exception as e:  # a plot is not worth a failed training run
            log.warning("could not refresh %s: %s", LOSS_PLOT, e)

    def write_recovery_tables(self) -> None:
        """Rebuild `recovery_history.json`, `replica_replacements.json`, `guard_events.json` and the
        recovery totals from the events (in the outbox: after every earlier record, retried while
        the store is unreachable)."""
        self.outbox.put(self._write_recovery_tables)

    def _write_recovery_tables(self) -> None:
        events = self.events()
        rows, guards = recovery.recovery_rows(events), recovery.guard_rows(events)
        replaced = recovery.replacement_rows(events, steps_logged_since(self.client, self.run_id, 0.0))
        if replaced:
            self.client.log_dict(self.run_id, recovery.split_table(replaced), recovery.REPLACEMENT_TABLE)
        # Written whole each time in `log_table`'s layout ({"columns", "data"}); `log_table` itself appends.
        if rows:
            self.client.log_dict(self.run_id, recovery.split_table(rows), recovery.RECOVERY_TABLE)
            ts = int(time.time() * 1000)
            self.client.log_batch(
                self.run_id, metrics=[Metric(k, float(v), ts, 0) for k, v in recovery.totals(rows).items()]
            )
        if guards:
            self.client.log_dict(self.run_id, recovery.split_table(guards), recovery.GUARD_TABLE)

    def finish(self, status: str) -> None:
        """End the run with `status` once the records so far are sent (at most `timeout_s`)."""
        self.drain()
        self.client.set_terminated(self.run_id, status=status)
