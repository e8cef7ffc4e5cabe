"""Members leaving after a step: nodes drained for preemption and stragglers excluded.

Every member of a step knows after it, alike, who leaves: how many members hold a drain notice
comes from the step's agreement (`StepMembers.agree`, `raytrain_ft.resilience.preemption`), which
are excluded from every member's `StragglerMonitor` judging the step's agreed figures
(`raytrain_ft.resilience.straggler.Exclusion`). The loop first saves the step where
`StepMembers.saves_before_leaving` says (the members that keep it durable; unless the step's
periodic save is already in flight), then calls `leave`.
"""

from __future__ import annotations

from collections.abc import Callable

from raytrain_ft.resilience.preemption import Preemption, wait_out
from raytrain_ft.resilience.step_members import StepMembers
from raytrain_ft.resilience.straggler import StragglerMonitor


def leave(
    step: int,
    excluded: list[int],
    saves: bool,
    saved: bool,
    members: StepMembers,
    preemption: Preemption,
    stragglers: StragglerMonitor,
    settle: Callable[[], object],
) -> bool:
    """After `step` (`excluded`: the split ranks of the members excluded as stragglers; `saves`:
    this member keeps the step durable with a checkpoint; `saved`: it did, the fingerprint before
    that save having passed, `guards.RankChecks.fit_to_save`): a member that saves it, holds a drain
    notice or is excluded waits until the step is registered (`settle`); an excluded one records
    its exclusion, a doomed one the notice (`Preemption.answer`); then the members end as
    `StepMembers.exclude` says (True: this rank ends the attempt, restart recovery's whole group),
    else a doomed replica leaves the quorum and waits for its node's end.

    Raises:
        StragglerExcluded: this replica is excluded (`Replicas.exclude`).
        NodePreempted: a doomed replica's node outlived its deadline (`preemption.wait_out`).
    """
    mine = members.rank in excluded
    if saves or preemption.held or mine:
        settle()
    if mine:
        stragglers.record_exclusion(step)
    notice = preemption.answer(step, saved=saved)
    if excluded and members.exclude(excluded):
        return True
    if notice and members.leave():
        # no beat while it waits: the deadline plus `PAST_DEADLINE_S` stays under the driver's
        # watchdog floor (`watchdog.MIN_STEP_TIMEOUT_S`) for the clouds' 30-120 s notices
        wait_out(notice)
    return False
