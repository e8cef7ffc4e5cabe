"""Which run a command means: `find_run` is how every `raytrain-ft` command that takes a RUN finds it.

RUN is, in this order (the first that matches wins):

1. a run folder (`run.storage_path/run.name`, a local path or an fsspec URL, that exists): its MLflow
   run is the one its run id file names (`run_folder.read_run_id`), in the tracking store;
2. an MLflow run id in the tracking store;
3. an MLflow run name (`run.name`) in the tracking store, in any experiment: exactly one run may
   have it (two submissions of one `run.name` to other storage paths are two runs: pass the id);
   its folder is the one the run logged (`run.storage_path`/`run.name` params).

The tracking store is `--tracking-uri`, else `MLFLOW_TRACKING_URI`, else the default sqlite store
(`raytrain_ft.telemetry.tracking.resolve_uri`); a command given a run folder that needs nothing from
MLflow (`verify`, `export` without `--register`) never opens it. Every miss is one line saying what to
pass instead (`ValueError`, the CLI's exit status 2).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import fsspec

from raytrain_ft.core.run_folder import read_run_id, run_root

if TYPE_CHECKING:
    from mlflow.entities import Run
    from mlflow.tracking import MlflowClient

PASS_INSTEAD = (
    "pass the run folder (run.storage_path/run.name), an MLflow run id, or a run name `raytrain-ft runs` lists"
)


def store(tracking_uri: str) -> MlflowClient:
    """An `MlflowClient` of the store `tracking_uri` names (default: as
    `raytrain_ft.telemetry.tracking.resolve_uri`).

    Raises:
        ValueError: a sqlite store that does not exist (MLflow would create an empty one).
    """
    from mlflow.tracking import MlflowClient

    from raytrain_ft.telemetry.tracking import resolve_uri

    uri = resolve_uri(tracking_uri)
    if uri.startswith("sqlite:///") and not os.path.exists(uri.removeprefix("sqlite:///")):  # MLflow would create it
        raise ValueError(
            f"no MLflow store at {uri}; point --tracking-uri (or MLFLOW_TRACKING_URI) at the store the run logged to"
        )
    return MlflowClient(uri)


@dataclass(frozen=True)
class FoundRun:
    """A run `find_run` found: `root` its run folder (local path or fsspec URL, no trailing slash;
    None: an MLflow run that logged no `run.storage_path`), `run_id` its MLflow run id (None: a run
    folder without a run id file, never submitted through the driver), `tracking_uri` the store it
    was found in (None: not opened, a run folder)."""

    root: str | None
    run_id: str | None
    tracking_uri: str | None

    def folder(self) -> str:
        """The run folder.

        Raises:
            ValueError: the MLflow run logged no `run.storage_path` and `run.name` params.
        """
        if self.root is None:
            raise ValueError(f"MLflow run {self.run_id} logged no run.storage_path and run.name; pass the run folder")
        return self.root

    def mlflow_run(self, tracking_uri: str) -> Run:
        """The run's MLflow `Run` (info, params, latest metrics) in `tracking_uri`'s store.

        Raises:
            ValueError: the folder names no MLflow run, or the store does not hold it.
        """
        from mlflow.exceptions import MlflowException

        client = store(self.tracking_uri or tracking_uri)
        if self.run_id is None:
            raise ValueError(f"the run folder {self.root} names no MLflow run (no run id file); {PASS_INSTEAD}")
        try:
            return client.get_run(self.run_id)
        except MlflowException:
            raise ValueError(
                f"the run folder {self.root} names MLflow run {self.run_id}, which {client.tracking_uri} does not "
                "have; point --tracking-uri (or MLFLOW_TRACKING_URI) at the store the run logged to"
            ) from None


def find_run(run: str, tracking_uri: str) -> FoundRun:
    """The run `run` names (the module's three rules, in order); opens the tracking store only when
    `run` is not a run folder.

    Raises:
        ValueError: the store does not exist, no rule matches, or several MLflow runs have the name
            (one line each, saying what to pass instead).
    """
    fs, path = fsspec.core.url_to_fs(run)
    if fs.isdir(path):
        return FoundRun(run.rstrip("/"), read_run_id(run), None)
    client = store(tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    by_id = client.search_runs(experiments, f"attributes.run_id = '{run}'") if len(run) == 32 and run.isalnum() else []
    matches = by_id or client.search_runs(experiments, f"attributes.run_name = '{run}'")
    if not matches:
        raise ValueError(
            f"no run {run!r}: not a run folder, nor an MLflow run id or run name in {client.tracking_uri}; "
            f"{PASS_INSTEAD}, or point --tracking-uri (or MLFLOW_TRACKING_URI) at the store the run logged to"
        )
    if len(matches) > 1:
        ids = ", ".join(sorted(r.info.run_id for r in matches))
        raise ValueError(f"{len(matches)} MLflow runs in {client.tracking_uri} are named {run!r} ({ids}): pass one id")
    found = matches[0]
    params = found.data.params
    named = "run.storage_path" in params and "run.name" in params
    root = run_root(params["run.storage_path"], params["run.name"]) if named else None
    return FoundRun(root, found.info.run_id, client.tracking_uri)
