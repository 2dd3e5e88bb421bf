"""The report's speculative-decoding section, metrics and budgets, on a hand-made run and on one without it.

The speculating run: 10 requests, each (times in ms after its token 0) a speculative step proposing 2 drafts
and accepting both (tokens 1-3: draft 1 ms, verify 3 ms), one proposing 2 and accepting none (token 4, same
times), then two plain tokens (decode.compute 2 ms each). So: acceptance 2 / 4 = 50%, 2 tokens per verify step,
draft 2 of 8 ms of draft + verify (25%) and of 12 ms of decode compute (1/6), half the draft time on rejected
proposals, and, with no steps table, a speculative step's time is its draft and verify: 8 ms over 4 tokens.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pytest

from tokentrace.app.report import make_report, render
from tokentrace.app.report.budget import parse_budgets
from tokentrace.app.report.speculative import NO_SPECULATION
from tokentrace.schema import INSTANCES, REQUESTS, SPANS, SPEC_STEPS, TOKENS, Role, Stage, col
from tokentrace.store import StoreWriter

MS = 1_000_000


def _table(t, rows: list[dict]) -> pa.Table:
    return pa.Table.from_pydict({c.name: [r.get(c.name) for r in rows] for c in t.columns}, schema=t.schema)


def _span(rid: int, stage: Stage, start: float, end: float, idx: int) -> dict:
    return {col.REQUEST_ID: rid, col.STAGE: int(stage), col.TOKEN_INDEX: idx, col.START_NS: int(start * MS),
            col.END_NS: int(end * MS), col.INSTANCE_ID: 1}


def _write_speculative_run(store: Path) -> None:
    requests, tokens, spans, spec = [], [], [], []
    for r in range(10):
        rid, t0 = 100 + r, r * 100.0
        requests.append({col.REQUEST_ID: rid, col.REQUEST_KEY: f"req-{r}", col.INSTANCE_ID: 1,
                         col.TENANT: ("acme", "globex")[r % 2], col.SLO_CLASS: "interactive",
                         col.ARRIVAL_NS: int(t0 * MS), col.FINISH_NS: int((t0 + 22) * MS), col.STATUS: 0})
        spans += [_span(rid, Stage.PREFILL_COMPUTE, t0, t0 + 10, 0)]
        sent = [t0 + 10]
        for first, accepted, start in ((1, 2, t0 + 10), (4, 0, t0 + 14)):
            spec.append({col.INSTANCE_ID: 1, col.REQUEST_ID: rid, col.STEP: first, col.DRAFT_SOURCE: 0,
                         col.NUM_PROPOSED: 2, col.NUM_ACCEPTED: accepted, col.FIRST_TOKEN_INDEX: first,
                         col.DRAFT_START_NS: int(start * MS), col.DRAFT_END_NS: int((start + 1) * MS),
                         col.VERIFY_START_NS: int((start + 1) * MS), col.VERIFY_END_NS: int((start + 4) * MS),
                         col.BATCH_SIZE: 1, col.NUM_SPEC_SEQS: 1})
            spans += [_span(rid, Stage.DECODE_DRAFT, start, start + 1, first),
                      _span(rid, Stage.DECODE_VERIFY, start + 1, start + 4, first)]
            sent += [start + 4] * (accepted + 1)
        for i in (5, 6):
            spans.append(_span(rid, Stage.DECODE_COMPUTE, sent[-1], sent[-1] + 2, i))
            sent.append(sent[-1] + 2)
        tokens += [{col.REQUEST_ID: rid, col.TOKEN_INDEX: i, col.EMIT_NS: int(s * MS), col.INSTANCE_ID: 1}
                   for i, s in enumerate(sent)]
    instances = [{col.INSTANCE_ID: 1, col.ROLE: int(Role.COLOCATED), col.NAME: "engine-0", col.HOST: "h",
                  col.PID: 1, col.MONO_ANCHOR_NS: 0, col.WALL_ANCHOR_NS: 0, col.CLOCK_OFFSET_NS: 0}]
    with StoreWriter(store, run_id="spec") as w:
        for t, rows in ((INSTANCES, instances), (REQUESTS, requests), (TOKENS, tokens), (SPANS, spans),
                        (SPEC_STEPS, spec)):
            w.write(t, _table(t, rows))
        w.register_instance(1, Role.COLOCATED, "engine-0")


@pytest.fixture(scope="module")
def spec_store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("spec")
    _write_speculative_run(store)
    return store


def test_the_section_says_what_speculation_did(spec_store):
    report = make_report(spec_store)
    section = report.section("speculative")
    assert section.title == "Speculative decoding"
    for words in ("20 speculative step(s) of 10 request(s)", "50.0% were accepted", "emitted 2.00 tokens",
                  "Drafting took 25.0% of the draft and verify time and 16.7% of all decode compute time",
                  "(50.0%) went to proposals the target rejected", "speculative steps cost 2.00 ms"):
        assert words in section.note, section.note
    captions = [c for c, _ in section.tables]
    assert captions[:3] == ["Acceptance by draft position (share of the steps that proposed it)",
                            "Accepted proposals per verify step",
                            "Speculative steps: proposals, acceptance and tokens per step"]
    (_, by_position), = [(c, df) for c, df in section.tables if c.startswith("Acceptance by draft position")]
    assert by_position["acceptance_rate"].tolist() == [0.5, 0.5]
    keys = [s.key for s in report.sections]
    assert keys.index("speculative") == keys.index("batch") + 1


# metric -> hand-computed value
SPEC_METRICS = {"spec.acceptance_rate": 0.5, "spec.draft_share_of_decode": 2 / 12, "spec.rejected_draft_share": 0.5,
                "spec.ms_per_token": 8 / 4, "spec.mean_itl": (4 + 0 + 0 + 4) / 4}


@pytest.mark.parametrize("metric", list(SPEC_METRICS))
def test_budget_metrics(spec_store, metric):
    assert make_report(spec_store).metrics[metric] == pytest.approx(SPEC_METRICS[metric])


def test_every_format_carries_the_section(spec_store):
    report = make_report(spec_store)
    md = render(report, "md")
    assert "## Speculative decoding" in md and "| acceptance rate (%) |" in md and "| 1 | 20 | 10 | 50.0% | 50.0% |" in md
    doc = json.loads(render(report, "json"))
    spec = doc["sections"]["speculative"]
    assert spec["tables"][2]["rows"][0]["acceptance_rate"] == 0.5  # the summary
    assert doc["metrics"]["spec.acceptance_rate"] == 0.5
    page = render(report, "html")
    assert "id='speculative'" in page and "chart-spec-acceptance" in page and "chart-spec-cost" in page


def test_budgets_on_speculation_pass_fail_and_are_not_measured_without_it(spec_store, planted_stores):
    budgets = parse_budgets({"budgets": ["spec.acceptance_rate >= 40%", "spec.ms_per_token <= 1.5ms"]})
    results = {r.budget.text: r for r in make_report(spec_store, budgets=budgets).budgets}
    assert results["spec.acceptance_rate >= 40%"].passed
    assert not results["spec.ms_per_token <= 1.5ms"].passed
    plain = make_report(planted_stores[0], budgets=budgets)
    assert all(math.isnan(r.actual) and not r.passed for r in plain.budgets)
    assert not [m for m in plain.metrics if m.startswith("spec.")]


def test_a_run_without_speculation_gets_one_sentence(planted_stores):
    report = make_report(planted_stores[0])
    section = report.section("speculative")
    assert section.note == NO_SPECULATION and section.tables == ()
    assert "chart-spec-" not in render(report, "html")
