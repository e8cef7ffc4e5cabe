"""Check what a person sees first on a run's page in MLflow's UI: headless Chromium, a real `mlflow server`.

    python scripts/check_mlflow_ui.py [--screenshot PATH]

Logs a run the way a training run does (`raytrain_ft.telemetry.tracking.start_or_resume_run` and the real
`StepTimeline`: steps 1-8 live, a commit at 4, a rollback discarding 5-6, steps 5-8 again, the
final `registered`) plus un-prefixed run metrics, serves the store with `mlflow server` on
127.0.0.1 (`raytrain_ft.launch.tracking_server.mlflow_server`), opens the run's *Model metrics*
tab in the model-training view
(`?workflowType=machine_learning`, as every link the project prints) with Debian's `chromium
--headless`, and reads the chart sections in the order the page shows them. Passes (exit 0, one
line) when the kept timeline `train` is the first section; else exit 1 naming the order.
Needs `chromium` (`apt-get install chromium`); a missing browser is one line and exit 2.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time

from mlflow.tracking import MlflowClient

from raytrain_ft.launch.tracking_server import mlflow_server
from raytrain_ft.telemetry.timeline import KEPT, StepTimeline
from raytrain_ft.telemetry.tracking import start_or_resume_run

SECTION = re.compile(r"(Model metrics|[\w.-]+) \((\d+)\) Add chart")  # a section header: "<name> (<charts>) Add chart"


def log_run(uri: str, root: str) -> tuple[str, str]:
    run_id = start_or_resume_run(uri, "ui-check", root, "ui-check", {"train.max_steps": 8})
    client = MlflowClient(uri)
    timeline, t0 = StepTimeline(client, run_id), time.time()
    for step in range(1, 7):
        timeline.record(step, {"loss": 6.0 - step / 4, "lr": 1e-3, "grad_norm": 1.0}, {"last_step": step}, t0 + step)
        if step == 4:
            timeline.committed(4)
    timeline.discard_after(4)  # a rollback to step 4
    for step in range(5, 9):
        timeline.record(step, {"loss": 6.0 - step / 4, "lr": 1e-3, "grad_norm": 1.0}, {"last_step": step}, t0 + step)
    timeline.committed(8)
    timeline.registered()
    client.log_metric(run_id, "goodput", 0.9, step=8)
    client.set_terminated(run_id)
    return client.get_run(run_id).info.experiment_id, run_id


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--screenshot", default="mlflow-ui-model-metrics.png", help="where to save the page (PNG)")
    args = parser.parse_args()
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("error: no chromium on PATH; install it with `apt-get install chromium`", file=sys.stderr)
        return 2
    tmp = tempfile.mkdtemp(prefix="mlflow-ui-check-")
    uri = f"sqlite:///{tmp}/mlflow.db"
    experiment_id, run_id = log_run(uri, f"{tmp}/run")
    with mlflow_server(uri, f"{tmp}/mlartifacts", "127.0.0.1") as url:  # the one the driver starts on a cluster
        page = f"{url}/#/experiments/{experiment_id}/runs/{run_id}/model-metrics?workflowType=machine_learning"
        browser = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=20000"]
        dom = subprocess.run([*browser, "--dump-dom", page], capture_output=True, text=True, timeout=120).stdout
        subprocess.run(
            [*browser, "--window-size=1400,1600", f"--screenshot={args.screenshot}", page],
            capture_output=True,
            timeout=120,
        )
    text = re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom))
    sections = [name for name, _ in SECTION.findall(text)]
    first = KEPT.rstrip("/")
    if sections[:1] != [first]:
        print(f"FAIL: the Model metrics sections read {sections}; the kept timeline '{first}' is not first")
        return 1
    print(f"ok: Model metrics sections in page order {sections}; screenshot {args.screenshot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
