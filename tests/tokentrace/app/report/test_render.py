"""The four renderers over one hand-made Report: Markdown, self-contained HTML, JSON, JUnit XML."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ET

import pandas as pd
import pytest

from tokentrace.app.report import render
from tokentrace.app.report.budget import Change, evaluate, parse_budgets
from tokentrace.app.report.model import Charts, Report, RunHeader
from tokentrace.app.report.render_md import markdown_table
from tokentrace.app.report.sections import Section
from tokentrace.schema import REQUESTS, TOKENS, col

LATENCY = pd.DataFrame({"metric": ["ttft", "tpot", "itl", "e2e"], "count": [4, 4, 12, 4],
                        "mean_ms": [12.5, 3.0, 3.1, 30.0], "p50_ms": [12.0, 3.0, 3.0, 29.0],
                        "p90_ms": [14.0, 3.5, 3.9, 33.0], "p99_ms": [15.0, 3.9, 4.4, 35.0],
                        "p99.9_ms": [15.1, 3.99, 4.49, 35.2]})
BREAKDOWN = pd.DataFrame({"stage": ["schedule.queue", "prefill.compute", "decode.compute", "unattributed"],
                          "ttft_mean_ms": [4.0, 8.0, 0.0, 0.5], "ttft_share": [0.32, 0.64, 0.0, 0.04],
                          "ttft_tail_share": [0.5, 0.5, 0.0, 0.0], "itl_mean_ms": [0.0, 0.0, 3.0, 0.1],
                          "itl_share": [0.0, 0.0, 0.97, 0.03], "itl_tail_share": [0.0, 0.0, 1.0, 0.0]})
WINDOWS = pd.DataFrame({"window_start_s": [0.0, 1.0, 0.0, 1.0], "metric": ["ttft", "ttft", "itl", "itl"],
                        "p50_ms": [10.0, 14.0, 3.0, 3.2], "p99_ms": [12.0, 15.0, 4.0, 4.4]})
BIG_ID = 4030198795875324637  # a real 63-bit instance id: never shown to a person, a string for machines
QUEUES = pd.DataFrame({col.INSTANCE_ID: [7, 7], "t_s": [0.0, 1.0], col.NUM_WAITING: [2.0, 0.0],
                       col.NUM_RUNNING: [3.0, 4.0], col.NUM_PREEMPTED: [0.0, 0.0]})
LITTLE = pd.DataFrame({col.INSTANCE_ID: [BIG_ID], "duration_s": [10.0], "relative_error": [-0.36],
                       "mean_in_system": [1234.5678]})
DIFF = pd.DataFrame({"metric": ["itl", "ttft"], "statistic": ["p99", "p99"], "baseline": [2.2, 15.0],
                     "candidate": [4.4, 15.1], "delta": [2.2, 0.1], "rel_change": [1.0, 0.0067],
                     "ci_low": [1.9, -0.5], "ci_high": [2.5, 0.6], "significant": [True, False],
                     "regression": [True, False]})


VERDICT = "SATURATED: arrivals outran service, offered 9.00 req/s over the 10.0 s arrival window, served 4.50 req/s."


def _header(run_id: str) -> RunHeader:
    return RunHeader(run_id=run_id, path=f"/stores/{run_id}", created="2026-11-29T10:00:00Z",
                     tokentrace_version="0.1.0", rows={REQUESTS.name: 4, TOKENS.name: 16},
                     instances=({"instance": 7, "role": "colocated", "name": "engine-0"},
                                {"instance": BIG_ID, "role": "decode", "name": "decode-0"}),
                     counters={"dropped": 0, "sampled_out": 2})


@pytest.fixture
def report() -> Report:
    budgets = parse_budgets({"budgets": ["ttft.p99 <= 20ms", "itl.p99 <= 4ms", "regression.itl.p99 <= +5%",
                                         "stage.schedule.queue.share_of_ttft <= 0.3"]})
    metrics = {"ttft.p99": 15.0, "itl.p99": 4.4, "stage.schedule.queue.share_of_ttft": 0.32}
    results = evaluate(budgets, metrics, {"itl.p99": Change(2.2, 4.4, True)})
    sections = (Section("latency", "Latency (server view)", "In ms.", (("", LATENCY),)),
                Section("stage_breakdown", "Stage breakdown", "Shares | of time <b>", (("Shares", BREAKDOWN),)),
                Section("cache", "Prefix cache", "Not available: the run has no cache_events rows."),
                Section("queues", "Queues", "Waiting requests over time are charted in the HTML report.",
                        (("Little's law", LITTLE),)),
                Section("diff", "Difference from the baseline", "1 significant regression(s).",
                        (("Significant changes", DIFF[DIFF["significant"]]),)))
    return Report(run=_header("cand"), baseline=_header("base"), sections=sections, metrics=metrics, diff=DIFF,
                  regressions=("itl p99: 2.200 ms -> 4.400 ms (+100.0%)",), budgets=results,
                  charts=Charts(latency=LATENCY, breakdown=BREAKDOWN, windows=WINDOWS, queues=QUEUES),
                  headline=(VERDICT, "Instances for the offered 9.00 req/s: decode 5 (75% busy; has 2)."),
                  load={"offered_rps": 9.0, "served_rps": 4.5, "saturated": True, "pool": "decode",
                        "stage": "decode.queue", "verdict": VERDICT})


def test_markdown_has_header_budgets_regressions_and_every_section(report):
    md = render(report, "md")
    assert md.startswith("# tokentrace report: run `cand`")
    lines = md.splitlines()
    assert lines[2] == f"**{VERDICT}**"  # the verdict is the first thing under the title
    assert lines[4].startswith("Instances for the offered")
    assert "**FAILED**: 3 of 4 budget(s) violated." in md
    assert "| ✅ | `ttft.p99 <= 20ms` | 15.0 ms |" in md
    assert "| ❌ | `itl.p99 <= 4ms` | 4.400 ms |" in md
    assert "- ⚠️ itl p99: 2.200 ms -&gt; 4.400 ms (+100.0%)" in md  # ">" as an entity: no HTML in Markdown
    for title in ("## Latency (server view)", "## Stage breakdown", "## Prefix cache", "## Difference from"):
        assert title in md
    assert "Not available: the run has no cache_events rows." in md
    assert "| schedule.queue | 4.00 | 32.0% | 50.0% |" in md  # shares as percentages
    table_rows = [line for line in md.splitlines() if line.startswith("| ttft |")]
    assert table_rows == ["| ttft | 4 | 12.50 | 12.00 | 14.00 | 15.00 | 15.10 |"]


def test_people_read_names_and_machines_read_ids_as_strings(report):
    md, page = render(report, "md"), render(report, "html")
    for text in (md, page):
        assert str(BIG_ID) not in text and "decode-0" in text  # the instance by name, in the header and tables
        assert "p99 (ms)" in text and "1,234.6" in text  # headers with units, numbers with separators
    assert "| decode-0 | 10.00 | -36.0% | 1,234.6 |" in md
    assert "charted in the HTML report" in md and "charted in the HTML report" not in page  # HTML: "above"
    assert "<div class='table-wrap'><table>" in page  # a wide table scrolls in its box, not the page
    doc = json.loads(render(report, "json"))
    assert doc["run"]["instances"][1]["instance"] == str(BIG_ID)  # exact: a JavaScript number would round it
    assert doc["run"]["instance_names"] == {"7": "colocated · engine-0", str(BIG_ID): "decode-0"}
    assert doc["sections"]["queues"]["tables"][0]["rows"][0]["instance"] == "decode-0"  # as the other formats
    assert not re.search(r"(?<![\d\"])\d{16,}", render(report, "json"))  # no bare 16+ digit number


def test_markdown_table_truncates_long_tables():
    df = pd.DataFrame({"n": range(60)})
    text = markdown_table(df, max_rows=50)
    assert text.count("\n| ") == 50 and "10 more row(s)" in text
    assert text.splitlines()[1] == "|---:|"


def test_markdown_table_escapes_pipes_and_formats_cells():
    df = pd.DataFrame({"stage": ["a|b"], "ttft_share": [0.25], "flagged": [True], "n": [1234567]})
    assert markdown_table(df).splitlines()[2] == "| a\\|b | 25.0% | yes | 1,234,567 |"


def test_html_is_self_contained_with_the_charts(report):
    page = render(report, "html")
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert not re.search(r"<script[^>]+src=[\"']?(https?:)?//", page), "no external scripts"
    assert not re.search(r"<link[^>]+href=[\"']?(https?:)?//", page), "no external stylesheets"
    assert "Plotly.newPlot" in page and len(page) > 1_000_000  # plotly.js is inlined
    for div in ("chart-latency", "chart-stages", "chart-latency-time", "chart-queues", "chart-diff"):
        assert f'id="{div}"' in page
    assert "Shares | of time &lt;b&gt;" in page  # text escaped
    assert "<li class='fail'>itl p99" in page
    assert page.index(VERDICT) < page.index("<h2>Budgets</h2>")  # the verdict opens the report


def test_html_says_so_when_there_is_nothing_to_chart(report):
    empty = Charts(latency=pd.DataFrame(), breakdown=pd.DataFrame(), windows=pd.DataFrame(), queues=pd.DataFrame())
    page = render(Report(report.run, None, report.sections, report.metrics, None, (), (), empty), "html")
    assert "No latency samples to chart." in page and "No stage spans to chart." in page
    assert "No time series" in page and "chart-latency" not in page and "chart-diff" not in page


def test_json_has_stable_keys_and_strict_numbers(report):
    doc = json.loads(render(report, "json"))
    assert list(doc) == ["format", "version", "passed", "headline", "load", "diagnosis", "run", "baseline", "metrics",
                         "budgets", "regressions", "diff", "sections"]
    assert doc["load"]["offered_rps"] == 9.0 and doc["load"]["served_rps"] == 4.5 and doc["load"]["saturated"] is True
    assert doc["headline"][0] == VERDICT
    assert doc["format"] == "tokentrace-report" and doc["version"] == 2 and doc["passed"] is False
    assert doc["run"]["run_id"] == "cand" and doc["baseline"]["run_id"] == "base"
    assert doc["metrics"]["ttft.p99"] == 15.0
    first = doc["budgets"][0]
    assert set(first) == {"budget", "metric", "op", "limit", "kind", "actual", "baseline", "passed", "message"}
    assert [b["passed"] for b in doc["budgets"]] == [True, False, False, False]
    assert doc["budgets"][2]["baseline"] == 2.2 and doc["budgets"][2]["kind"] == "relative"
    latency = doc["sections"]["latency"]["tables"][0]
    assert latency["columns"][:3] == ["metric", "count", "mean_ms"] and latency["rows"][0]["p99.9_ms"] == 15.1
    assert doc["sections"]["cache"]["tables"] == []
    assert doc["diff"][0]["significant"] is True and doc["regressions"] == [report.regressions[0]]


def test_json_writes_nan_as_null(report):
    metrics = dict(report.metrics, **{"tpot.p99": float("nan")})
    doc = json.loads(render(Report(report.run, None, (), metrics, None, (), (), report.charts), "json"))
    assert doc["metrics"]["tpot.p99"] is None and doc["baseline"] is None and doc["diff"] is None


def test_junit_has_one_case_per_budget_and_failures_with_actual_and_limit(report):
    root = ET.fromstring(render(report, "junit").encode())
    assert root.tag == "testsuites" and root.get("tests") == "4" and root.get("failures") == "3"
    (suite,) = root.findall("testsuite")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == [r.budget.text for r in report.budgets]
    assert cases[0].find("failure") is None
    failure = cases[1].find("failure")
    assert failure.get("message") == "itl.p99 = 4.400 ms violates limit <= 4.000 ms"
    assert "measured: 4.400 ms" in failure.text and "limit: <= 4.000 ms" in failure.text
    props = {p.get("name"): p.get("value") for p in suite.find("properties")}
    assert props == {"run_id": "cand", "store": "/stores/cand", "baseline_run_id": "base"}


def test_junit_without_budgets_is_an_empty_valid_suite(report):
    bare = Report(report.run, None, report.sections, report.metrics, None, (), (), report.charts)
    root = ET.fromstring(render(bare, "junit").encode())
    assert root.get("tests") == "0" and root.find("testsuite").findall("testcase") == []
