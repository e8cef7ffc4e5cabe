"""`preemption.Preemption`: a drain notice is held for the step that agrees on it, answered once
after that step committed, with one `preemption` event per node (no Ray: the notice is given)."""

import time

import pytest

from raytrain_ft.core.recorder import NullRecorder
from raytrain_ft.resilience.preemption import NodePreempted, Notice, Preemption, wait_out


class Events(NullRecorder):
    def __init__(self):
        self.events: list[dict] = []

    def event(self, kind: str, **fields: object) -> None:
        self.events.append({"kind": kind, **fields})


class Session:
    def __init__(self, notice: Notice | None):
        self.notice, self.events = notice, Events()

    def preemption_notice(self) -> Notice | None:
        return self.notice

    def recorder(self, attempt: bool) -> Events:
        return self.events


def test_a_notice_is_answered_once_with_the_step_saved_and_the_seconds_to_the_commit():
    noticed = time.time() - 3.0
    session = Session(None)
    p = Preemption(session, rank=1)
    assert not p.take() and p.answer(5, saved=True) is None  # no notice: a peer's, nothing recorded
    session.notice = Notice("n1", noticed, noticed + 30.0, records=True)
    assert p.take()
    assert p.answer(7, saved=True) == session.notice
    [event] = session.events.events
    assert event["kind"] == "preemption" and event["node"] == "n1" and event["rank"] == 1
    assert (event["notice_time"], event["deadline"], event["step_saved"]) == (noticed, noticed + 30.0, 7)
    assert event["checkpoint"] is True
    assert 3.0 <= event["notice_to_committed_s"] < 4.0 and 26.0 < event["deadline_left_s"] <= 27.0
    assert not p.take()  # answered: the same notice makes no second save
    session.notice = Notice("n1", noticed, noticed + 60.0, records=True)  # a new drain of the node
    assert p.take()


def test_a_second_worker_of_the_node_records_nothing():
    session = Session(Notice("n1", time.time(), None, records=False))
    p = Preemption(session, rank=2)
    assert p.take() and p.answer(3, saved=False) is not None
    assert session.events.events == []


def test_a_node_that_outlives_its_deadline_ends_the_wait():
    with pytest.raises(NodePreempted, match="node n1 .* outlived its deadline"):
        wait_out(Notice("n1", time.time() - 200.0, time.time() - 20.0, records=True))
