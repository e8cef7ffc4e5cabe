"""Bounded waits: every wait of a run ends within a bound from the config, in a counted failure or one line.

The table of every wait, its bound, its config key and what happens when it expires is
docs/hangs-and-waits.md#every-wait-is-bounded. This module holds what those waits share:

* `WaitTimeoutError`: a wait that expired inside a worker. It is an ordinary exception (not a
  `UserError`), so the attempt fails and Ray Train restarts the group, counted against
  `failure.max_failures`; its message is the one line the run's failure line and history show.
* `bounded(items, timeout_s, what)`: an iterator whose every item must arrive within `timeout_s`
  (the data pipeline's batches).
* `wait_for(done, timeout_s, what)`: poll `done()` until it holds (the commit acknowledgement).
* `conflicts(cfg, checkpoint_bytes)`: bounds that cannot work together, one line each, for
  `raytrain-ft check` (`raytrain_ft.training.preflight`). Pure: no Ray, no I/O.

Imports no Ray: the loop and preflight use it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from raytrain_ft.core.config import Config

T = TypeVar("T")

# Ray Train's controller polls each worker's reports this often (`RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`,
# set for every worker and the controller in `launch.driver.WORKER_ENV`): a commit is registered at
# the next poll, so a commit wait shorter than this always expires.
HEALTH_CHECK_INTERVAL_S = 0.5
# torchft's lighthouse lets replicas join a quorum for this long (`replicas.LIGHTHOUSE`'s `join_timeout_ms`).
LIGHTHOUSE_JOIN_S = 10.0
# What `conflicts` assumes one rank writes to storage per second when it sizes the slowest checkpoint
# stage (the write, during which the ranks that finished wait for the others in DCP's gather and the
# commit barrier): a conservative figure for a network file system or object store from one node.
ASSUMED_WRITE_BYTES_PER_S = 200e6
POLL_S = 0.05


class WaitTimeoutError(TimeoutError):
    """A bounded wait expired (the message names the wait, the bound and its config key)."""


def bounded(items: Iterator[T], timeout_s: float, what: str) -> Iterator[T]:
    """`items`, each fetched on a daemon thread ("bounded-fetch", named in stack dumps) and waited
    for at most `timeout_s` seconds; an item's error is raised here. Nothing is read ahead.

    Raises:
        WaitTimeoutError: an item took longer: "`what` gave nothing for N s (waits.data_timeout_s); ...".
    """
    while True:
        box: queue.Queue = queue.Queue(1)
        threading.Thread(target=_fetch, args=(items, box), name="bounded-fetch", daemon=True).start()
        try:
            ok, item = box.get(timeout=timeout_s)
        except queue.Empty:
            raise WaitTimeoutError(
                f"{what} gave nothing for {timeout_s:g} s (waits.data_timeout_s); the read is stalled"
            ) from None
        if not ok:
            if item is None:
                return
            raise item
        yield item


def _fetch(items: Iterator, box: queue.Queue) -> None:
    try:
        box.put((True, next(items)))
    except StopIteration:
        box.put((False, None))
    except BaseException as e:  # raised in the waiting thread
        box.put((False, e))


def wait_for(done: Callable[[], bool], timeout_s: float, what: str, key: str) -> None:
    """Return once `done()` holds, polling every `POLL_S` seconds for at most `timeout_s`.

    Raises:
        WaitTimeoutError: "`what` did not happen within N s (`key`)".
    """
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise WaitTimeoutError(f"{what} did not happen within {timeout_s:g} s ({key})")
        time.sleep(POLL_S)


def conflicts(cfg: Config, checkpoint_bytes: int | None = None) -> list[str]:
    """Bounds of `cfg` that cannot work together, one line each (empty: none).

    Args:
        checkpoint_bytes: the most bytes one rank writes per checkpoint (the memory plan's
            parameters and optimizer state per device, GPU runs), or None when unknown (no check).
    """
    f, w = cfg.failure, cfg.waits
    found = []
    if checkpoint_bytes is not None:
        write_s = checkpoint_bytes / ASSUMED_WRITE_BYTES_PER_S
        if f.collective_timeout_s < 2 * write_s:
            found.append(
                f"failure.collective_timeout_s={f.collective_timeout_s:g} is shorter than twice the slowest checkpoint "
                f"stage of the plan (one rank writes {checkpoint_bytes / 1e9:.1f} GB: about {write_s:.0f} s at "
                f"{ASSUMED_WRITE_BYTES_PER_S / 1e6:.0f} MB/s), which ranks wait out in the save's collectives; "
                f"raise it to at least {2 * write_s:.0f}"
            )
    if w.commit_timeout_s <= 2 * HEALTH_CHECK_INTERVAL_S:
        found.append(
            f"waits.commit_timeout_s={w.commit_timeout_s:g} is not longer than two of Ray Train's report polls "
            f"({HEALTH_CHECK_INTERVAL_S:g} s each): a commit is registered at a poll, so every wait would expire; "
            f"raise it above {2 * HEALTH_CHECK_INTERVAL_S:g}"
        )
    if cfg.failure.recovery == "replica" and w.quorum_timeout_s <= LIGHTHOUSE_JOIN_S:
        found.append(
            f"waits.quorum_timeout_s={w.quorum_timeout_s:g} is not longer than the lighthouse's join window "
            f"({LIGHTHOUSE_JOIN_S:g} s): the first quorum times out while replicas may still join; raise it above "
            f"{LIGHTHOUSE_JOIN_S:g}"
        )
    return found
