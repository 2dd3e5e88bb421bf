"""The diagnosis against planted faults of the real reference server, the truth decided from the client and the
raw store (``tests/planted_runs.py``), never from the analyzers.

For each planted kind and mode, the targets are ones the planted fault breaks (a queue-type fault: TTFT;
a fault inside the token stream: ITL). Over the requests the fault hit that missed a target, the first
cause must be the planted one (recall); over the requests given that cause first, the fault must have hit
them (precision). A fault-free run, judged on its classes' targets, names no cause but ``overload`` or
``burst``; the report's first screen names the planted cause and its fix.

Measured on a 2-core machine shared with other work (``benchmarks/diagnosis_accuracy.py`` and single runs, with
and without both cores kept busy, load average up to 16; docs/diagnosis.md "How well it does"), precision is 1.0
for every kind. Recall: overload, KV transfer, noisy neighbour, slow stream send, prefix miss and preemption 1.0
in every run, colocated and disaggregated. The planted scenarios make the planted cause the largest delay on the
requests it hits, whatever else runs on the machine: recomputing an evicted 440-token prefix takes 14 steps of a
32-token budget, and the requests queued behind those recomputes wait for them (``prefix_miss`` too); a
preemption victim waits for the requests that kept their KV blocks to finish (60-300 ms), and the truth counts
a preemption that held a gap past the 40 ms ITL target it is judged on (``PREEMPTED_GAP_MS``: with 20 ms,
event-loop lag on a machine at load 15 outweighed the preemption of one victim in five); a
stream send of 30 ms against a 15 ms ITL target; a long prompt holds the step budget for about 0.5 s of slept
prefill cost, and the truth counts a request in flight beside it for the 100 ms TTFT target (``HOL_TTFT_MS``;
less is unsure, in neither figure); a noisy tenant's burst holds the quiet requests sent while one of its requests
is in flight (those sent after its last finish, behind only the backlog it left, are unsure): head-of-line 1.0 colocated, 0.97-1.0 disaggregated, 30-46 requests hit in a
run. Every kind is held to the bar but preemption, whose 5 hit requests would allow no loss: 0.8. On every kind,
the planted cause is named among the causes (at any rank) of at least ``NAMED_FLOOR`` of the requests it hit
that missed (measured 0.8-1.0).
"""

from __future__ import annotations

import json
import shutil

import pytest
from planted_runs import HOL_TTFT_MS, PREEMPTED_GAP_MS, SCENARIOS

import tokentrace
from analyzers.diagnosis import Targets
from tokentrace.app.report import make_report, render
from tokentrace.schema import col

pytestmark = pytest.mark.timeout(600)

BAR = 0.9  # the precision and recall bar
TARGETS = {
    "head_of_line": Targets(ttft_ms=HOL_TTFT_MS),
    "prefix_miss": Targets(ttft_ms=5),
    "preemption": Targets(itl_ms=PREEMPTED_GAP_MS),
    "kv_transfer": Targets(itl_ms=30),
    "noisy_neighbour": Targets(ttft_ms=100),
    "slow_stage": Targets(itl_ms=15),
    "overload": Targets(ttft_ms=200),
}
RECALL_FLOOR = {  # 1.0 in every run measured, with both cores busy; 5 requests hit, so the bar would allow no loss
    ("preemption", "colocated"): 0.8, ("preemption", "disagg"): 0.8,
}
NAMED_FLOOR = 0.8  # of the requests the fault hit that missed, those given the planted cause at any rank
CASES = [(kind, mode) for kind, s in SCENARIOS.items() if kind != "none" for mode in s.modes]


def _causes(run, targets: Targets) -> tuple[dict[str, str], set[str]]:
    """Each missed request's first cause, and the requests the planted cause is named for (at any rank)."""
    d = tokentrace.open(run.store, run.run).analyze().diagnosis(
        ttft_ms=targets.ttft_ms, itl_ms=targets.itl_ms, e2e_ms=targets.e2e_ms)
    named = set(d.causes[d.causes["cause"] == run.cause][col.REQUEST_KEY])
    return dict(zip(d.requests[col.REQUEST_KEY], d.requests["first_cause"])), named


@pytest.mark.parametrize(("kind", "mode"), CASES)
def test_the_first_cause_is_the_planted_one(planted_run, kind, mode):
    run = planted_run(kind, mode)
    first, named = _causes(run, TARGETS[kind])
    hit_missed = run.hit & set(first)
    given = {k for k, cause in first.items() if cause == run.cause} - run.unsure  # unsure: neither hit nor spared
    assert hit_missed, f"{kind}/{mode}: no request the fault hit missed its target: {first}"
    recall = len(given & hit_missed) / len(hit_missed)
    floor = RECALL_FLOOR.get((kind, mode), BAR)
    assert recall >= floor, (f"{kind}/{mode}: recall {recall:.2f} < {floor}: "
                             f"{ {k: first[k] for k in sorted(hit_missed - given)} }")
    named_recall = len(named & hit_missed) / len(hit_missed)
    assert named_recall >= NAMED_FLOOR, (f"{kind}/{mode}: the planted cause is named for {named_recall:.2f} of the "
                                         f"requests it hit: not for {sorted(hit_missed - named)}")
    if given:
        precision = len(given & run.hit) / len(given)
        assert precision >= BAR, f"{kind}/{mode}: precision {precision:.2f}: given but not hit {sorted(given - run.hit)}"


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_a_fault_free_run_names_no_cause_but_the_load(planted_run, mode):
    run = planted_run("none", mode)
    analysis = tokentrace.open(run.store, run.run).analyze()
    d = analysis.diagnosis()
    assert set(d.causes["cause"]) <= {"overload", "burst"}, d.causes[[col.REQUEST_KEY, "cause", "evidence"]]
    if "overload" in set(d.causes["cause"]):
        assert analysis.load().row["saturated"] is True


@pytest.mark.parametrize(("kind", "mode"), [("overload", "colocated"), ("kv_transfer", "disagg"),
                                            ("slow_stage", "disagg"), ("noisy_neighbour", "colocated"),
                                            ("head_of_line", "colocated"), ("prefix_miss", "disagg"),
                                            ("preemption", "colocated")])
def test_the_reports_first_screen_names_the_planted_cause_and_its_fix(planted_run, tmp_path, kind, mode):
    run = planted_run(kind, mode)
    copy = tmp_path / run.run
    shutil.copytree(run.store / run.run, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    t = TARGETS[kind]  # the targets go where `tokentrace bench --slo` puts them: the run's manifest
    manifest.setdefault("config", {})["slo_ms"] = {"ttft": t.ttft_ms or 30_000.0, "tpot": t.itl_ms or 1_000.0}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    report = make_report(tmp_path, run.run)
    first_screen = render(report, "md").split("\n- store:")[0]
    assert first_screen.split("\n")[2].startswith("**SLO MISSED:"), first_screen
    named = [line for line in first_screen.split("\n") if line.startswith("Why #") and f": {run.cause}" in line]
    assert named and "Fix: " in named[0], first_screen
    assert first_screen.index(named[0]) < first_screen.index(report.load["verdict"][:30])
    if kind != "noisy_neighbour":  # there, the noisy tenant's own requests queued behind its burst: a burst
        assert report.diagnosis["causes"][0]["cause"] == run.cause, report.diagnosis["causes"]
