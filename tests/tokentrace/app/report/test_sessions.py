"""The sessions section and the retention comparison: two runs of the same session workload, one whose
retention keeps every session's KV and one that drops it, compared with ``--baseline``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.append(str(Path(__file__).resolve().parents[3] / "analyzers"))  # the shared session workload

from session_runs import run_sessions  # noqa: E402

from tokentrace.app.report import make_report, render  # noqa: E402
from tokentrace.app.report.budget import BudgetError, parse_budgets  # noqa: E402
from tokentrace.app.report.sessions import NO_SESSIONS, session_comparison  # noqa: E402


@pytest.fixture(scope="module")
def policy_store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("sessions")
    for policy in ("keep", "drop"):
        run_sessions(policy=policy, num_turns=2, num_device_blocks=64, filler=0, store=store, run_id=policy)
    return store


def test_the_sessions_section_says_what_was_reused_and_lost(policy_store):
    keep = make_report(policy_store, "keep")
    section = keep.section("sessions")
    assert "of 48 prompt tokens the sessions' previous turns had computed, 100.0% were served" in section.note
    assert "No carried token was lost" in section.note and "pinned 12 block(s)" in section.note
    assert keep.metrics["session.reuse_fraction"] == 1.0 and keep.metrics["session.lost_tokens"] == 0
    drop = make_report(policy_store, "drop")
    assert "48 carried tokens were lost during think time in 2 turn(s)" in drop.section("sessions").note
    (caption, per_session), = drop.section("sessions").tables
    assert per_session["lost_tokens"].tolist() == [24, 24]


def test_retention_policies_compared_run_against_run(policy_store):
    report = make_report(policy_store, "drop", baseline=f"{policy_store}:keep")
    (_, table), = report.section("sessions_diff").tables
    rows = table.set_index("metric")
    assert rows.loc["session.reuse_fraction", "baseline"] == 1.0 and rows.loc["session.reuse_fraction", "candidate"] == 0
    assert rows.loc["session.lost_tokens", "delta"] == 48
    assert rows.loc["session.extra_prefill", "candidate"] > 0
    assert "Sessions against the baseline (keep)" in render(report, "md")
    assert json.loads(render(report, "json"))["metrics"]["session.lost_tokens"] == 48


def test_a_run_without_sessions_says_so(engine_store):
    assert make_report(engine_store).section("sessions").note == NO_SESSIONS


def test_comparison_keeps_metrics_only_one_run_has():
    table = session_comparison({"session.lost_tokens": 5.0}, {})
    assert table["metric"].tolist() == ["session.lost_tokens"] and pd.isna(table["baseline"].iloc[0])


def test_budgets_gate_on_session_metrics(policy_store):
    budgets = parse_budgets({"budgets": ["session.reuse_fraction >= 0.9", "session.extra_prefill <= 1000ms",
                                         "regression.session.lost_tokens <= +10%"]})
    report = make_report(policy_store, "drop", baseline=f"{policy_store}:keep", budgets=budgets)
    verdicts = {r.budget.metric: r.passed for r in report.budgets}
    assert verdicts == {"session.reuse_fraction": False, "session.extra_prefill": True,
                        "regression.session.lost_tokens": False}
    with pytest.raises(BudgetError, match="needs a unit"):
        parse_budgets({"budgets": ["session.load <= 5"]})
