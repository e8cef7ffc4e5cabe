"""A drain notice for preemption (a spot VM reclaimed): what the loop does at the next step boundary.

The runtime tells each worker whether its own node is being drained (`Session.preemption_notice`:
Ray's drain with reason `DRAIN_NODE_REASON_PREEMPTION` and a deadline, which is how GKE and AWS spot
notices reach Ray; `raytrain_ft.launch.preemption` reads it). The notice is local to the worker and
arrives at any moment, so the members of a step agree on it in the step's agree all-reduce
(`StepMembers.agree`: how many of them hold an unanswered notice), and every member acts on it after
the same step:

* restart recovery: every rank saves that step and waits until the checkpoint is registered; the
  group trains on until Ray Train restarts it at the deadline, on the nodes that remain (at another
  world size when `scaling.num_workers` is a range), from that checkpoint or a later one.
* replica recovery: the doomed replicas leave the quorum after that committed step and wait for
  their node's end (the others train on without them and without a restart; Ray Train replaces a
  replica whose node went once a node with room for it exists). Only when every replica of the step
  is doomed does the step's saver write a checkpoint first.

Each worker of a doomed node records a `preemption` event (`Preemption.answer`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from raytrain_ft.core.recorder import Recorder

log = logging.getLogger(__name__)

# A drain without a deadline: how long a doomed replica waits for its node to go (Ray Train's own
# fallback for a notice without a deadline, `DEFAULT_PREEMPTION_DEADLINE_S`).
NO_DEADLINE_WAIT_S = 120.0
# How long past the deadline a doomed replica waits for its node to go before it ends itself.
PAST_DEADLINE_S = 10.0


@dataclass(frozen=True)
class Notice:
    """A drain notice for this worker's node. `noticed_at`: when this worker first saw it (unix
    seconds; up to the runtime's poll interval after the drain); `deadline`: when the node goes (unix
    seconds; None: the drain gave none); `records`: this worker records its rank's event."""

    node: str
    noticed_at: float
    deadline: float | None
    records: bool


class NodePreempted(RuntimeError):
    """A doomed replica's node outlived its drain deadline: the replica ends so that it is replaced."""


class Preemption:
    """This rank's side of drain notices. `take()` before the step's agreement (whether this rank
    holds a notice not yet answered, kept for the step); `answer(step, saved)` once that step is
    committed: records the `preemption` event and returns the notice, None when the step's leaving
    members are others."""

    def __init__(self, session, rank: int):
        self.session, self.rank = session, rank
        self.answered: set[tuple[str, float | None]] = set()
        self.held: Notice | None = None

    def take(self) -> bool:
        notice = self.session.preemption_notice()
        self.held = notice if notice and (notice.node, notice.deadline) not in self.answered else None
        return self.held is not None

    def answer(self, step: int, saved: bool) -> Notice | None:
        """The `preemption` event: `node`, `notice_time` and `deadline` (unix seconds), `step_saved`
        (the step every member committed after the notice; `checkpoint`: whether a checkpoint of it
        was written and registered, else live replicas hold it), `notice_to_committed_s` and
        `deadline_left_s` (seconds from the notice to that commit, and from it to the deadline)."""
        notice, self.held = self.held, None
        if notice is None:
            return None
        self.answered.add((notice.node, notice.deadline))
        now = time.time()
        event = {
            "node": notice.node,
            "rank": self.rank,
            "notice_time": notice.noticed_at,
            "deadline": notice.deadline,
            "step_saved": step,
            "checkpoint": saved,
            "notice_to_committed_s": now - notice.noticed_at,
            "deadline_left_s": None if notice.deadline is None else notice.deadline - now,
        }
        log.warning("rank %d: node %s drained for preemption: step %d committed", self.rank, notice.node, step)
        if notice.records:
            recorder: Recorder = self.session.recorder(attempt=False)
            recorder.event("preemption", **event)
        return notice


def wait_out(notice: Notice) -> None:
    """Wait for the node's end (the process goes with it) until `PAST_DEADLINE_S` after the deadline.

    Raises:
        NodePreempted: the node is still there then.
    """
    deadline = notice.deadline if notice.deadline is not None else notice.noticed_at + NO_DEADLINE_WAIT_S
    time.sleep(max(0.0, deadline + PAST_DEADLINE_S - time.time()))
    raise NodePreempted(f"node {notice.node} was drained for preemption but outlived its deadline")
