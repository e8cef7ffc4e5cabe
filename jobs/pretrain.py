"""Pretraining job: `python jobs/pretrain.py --config configs/demo.yaml [key=value ...]`.

The preflight checks that need no cluster run first (`check_before_ray`). Under `ray job submit` it
connects to that cluster; run directly it starts a local Ray instance with explicit small resources.
Exit status 2 with a one-line message on a user error.
"""

import argparse
import logging
import signal
import sys

import ray

from raytrain_ft.core.config_files import load_config
from raytrain_ft.core.errors import UserError
from raytrain_ft.launch import ray_start
from raytrain_ft.launch.driver import Terminated, job_runtime_env, run
from raytrain_ft.launch.tracking_server import lasting_path
from raytrain_ft.training.preflight import problems


def check_before_ray(cfg) -> None:
    """The preflight checks that need no cluster (what `raytrain-ft check` runs without an address),
    before Ray starts or is connected to: a missing dataset or a bad config is one line in a second,
    not after a local Ray start. The driver's full preflight (with the cluster's resources) runs
    again once connected (`raytrain_ft.launch.driver.run`).

    Raises:
        UserError: the first problem found.
    """
    cfg.data.path = lasting_path(cfg.data.path, "data.path")
    cfg.run.storage_path = lasting_path(cfg.run.storage_path, "run.storage_path")
    found = problems(cfg, None)
    if found:
        raise found[0]


def init_ray(num_cpus: int) -> None:
    # the dashboard (on 127.0.0.1) serves the State API that Ray Train's placement-group cleaner polls;
    # without it the cleaner logs "State API may be temporarily unavailable" every second
    ray_start.start(num_cpus, include_dashboard=True, runtime_env=job_runtime_env())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=None, help="YAML config file (default: built-in defaults)")
    p.add_argument("--num-cpus", type=int, default=2, help="logical CPUs of a local Ray instance")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=40")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg = load_config(args.config, args.overrides)
        check_before_ray(cfg)
        init_ray(args.num_cpus)
        run_id = run(cfg)
    except UserError as e:
        message, status = f"error: {e}", 2
    except Terminated as e:
        message = f"run {cfg.run.name} {e}; its MLflow run is KILLED; submit the job again to resume it"
        status = 128 + signal.SIGTERM
    else:
        message, status = f"run {cfg.run.name} finished; MLflow run id {run_id}", 0
    ray.shutdown()  # stops Ray's forwarded worker logs, so the job's last line is this one
    print(message, file=sys.stderr if status else sys.stdout)
    return status


if __name__ == "__main__":
    sys.exit(main())
