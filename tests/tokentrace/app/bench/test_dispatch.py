"""The dispatcher on one event loop: a start chosen by the caller, a stop, and the collector left as it was."""

from __future__ import annotations

import asyncio
import gc
import time

from tokentrace.app.bench.arrivals import Arrivals
from tokentrace.app.bench.client import RequestOptions
from tokentrace.app.bench.dispatch import RunLimits, dispatch
from tokentrace.app.bench.plan import build_plan
from tokentrace.app.bench.requests import Outcome, PlannedRequest
from tokentrace.app.bench.synthetic import LengthDist, SyntheticSpec

SPEC = SyntheticSpec(LengthDist("fixed", 16), LengthDist("fixed", 4))


class Notes:
    def __init__(self) -> None:
        self.sent: list[int] = []
        self.done: list[Outcome] = []

    def on_sent(self, req: PlannedRequest) -> None:
        self.sent.append(req.index)

    def on_done(self, req: PlannedRequest, outcome: Outcome) -> None:
        assert outcome.index == req.index
        self.done.append(outcome)


def test_a_start_in_the_future_is_kept_and_the_collector_is_unfrozen_after(fake_url):
    plan = build_plan(synthetic=SPEC, max_requests=6, arrivals=Arrivals("constant", 50.0))
    notes = Notes()
    start_ns = time.monotonic_ns() + 200_000_000  # as the sender processes get it: 200 ms ahead
    outcomes, start = asyncio.run(dispatch(plan.requests, RequestOptions(fake_url, model="ok"),
                                           RunLimits(duration_s=20), listener=notes, start_ns=start_ns))
    assert start == start_ns and notes.sent == [0, 1, 2, 3, 4, 5] and len(notes.done) == 6
    for o, r in zip(outcomes, plan.requests):
        assert o.ok and o.send_ns >= start_ns + round(r.offset_s * 1e9)
    assert gc.get_freeze_count() == 0


def test_stop_ends_the_run_and_cancels_what_is_in_flight(fake_url):
    plan = build_plan(synthetic=SPEC, max_requests=50, arrivals=Arrivals("constant", 20.0))  # 2.5 s of sends
    notes = Notes()

    async def go() -> list[Outcome]:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(0.3, stop.set)
        outcomes, _ = await dispatch(plan.requests, RequestOptions(fake_url, model="slow"),
                                     RunLimits(duration_s=30), listener=notes, stop=stop)
        return outcomes

    outcomes = asyncio.run(go())
    assert 1 <= len(outcomes) < 50 and all(o.cancelled for o in outcomes)  # "slow" pauses 3 s after a token
    assert sorted(o.index for o in notes.done) == notes.sent == [o.index for o in outcomes]
