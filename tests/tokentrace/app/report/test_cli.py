"""``tokentrace report`` on the command line: formats, outputs, exit codes 0 / 1 / 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tokentrace.app.cli import app, register_commands
from tokentrace.schema import SPANS

register_commands()
runner = CliRunner()
REPO = Path(__file__).resolve().parents[4]


def _budget(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tokentrace.toml"
    path.write_text(text)
    return path


def test_markdown_to_stdout_by_default(planted_stores):
    _, cand = planted_stores
    result = runner.invoke(app, ["report", str(cand)])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("# tokentrace report: run `cand`")
    assert "## Where the time went: stage breakdown" in result.stdout


def test_every_format_to_a_folder(planted_stores, tmp_path):
    base, cand = planted_stores
    budget = _budget(tmp_path, '[budgets]\n"itl.p99" = "<= 1s"\n"unattributed.share" = "<= 1%"\n')
    out = tmp_path / "out"
    result = runner.invoke(app, ["report", str(cand), "--baseline", f"{base}:base", "--budget", str(budget),
                                 "--format", "md,html,json,junit", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["junit.xml", "report.html", "report.json", "report.md"]
    doc = json.loads((out / "report.json").read_text())
    assert doc["passed"] is True and doc["baseline"]["run_id"] == "base" and len(doc["budgets"]) == 2
    cases = ET.parse(out / "junit.xml").getroot().find("testsuite").findall("testcase")
    assert [c.get("name") for c in cases] == ["itl.p99 <= 1s", "unattributed.share <= 1%"]
    assert all(c.find("failure") is None for c in cases)
    page = (out / "report.html").read_text()
    assert not re.search(r"<script[^>]+src=", page) and "Plotly.newPlot" in page
    assert "**PASSED**: all 2 budget(s) hold." in (out / "report.md").read_text()


def test_violated_budget_exits_1_after_writing_the_reports(planted_stores, aa_store, tmp_path):
    base, cand = planted_stores
    budget = _budget(tmp_path, 'budgets = ["itl.p99 <= 8ms", "regression.itl.p99 <= +5%", "ttft.p99 <= 1s"]\n')
    out = tmp_path / "out"
    result = runner.invoke(app, ["report", str(cand), "--baseline", str(base), "--budget", str(budget),
                                 "--noise", f"{aa_store}:aa-*", "--format", "junit,json", "--out", str(out)])
    assert result.exit_code == 1, result.output
    violated = [line for line in result.stderr.splitlines() if line.startswith("budget violated: ")]
    assert len(violated) == 2 and "itl.p99 = " in violated[0] and "regression.itl.p99 = +" in violated[1]
    root = ET.parse(out / "junit.xml").getroot()
    assert root.get("tests") == "3" and root.get("failures") == "2"
    failures = [c.find("failure") for c in root.iter("testcase")]
    assert failures[0] is not None and "violates limit <= 8.000 ms" in failures[0].get("message")
    assert failures[2] is None
    assert json.loads((out / "report.json").read_text())["passed"] is False


def test_the_same_regression_budget_passes_against_itself(planted_stores, tmp_path):
    base, _ = planted_stores
    budget = _budget(tmp_path, 'budgets = ["regression.itl.p99 <= +5%"]\n')
    result = runner.invoke(app, ["report", str(base), "--baseline", str(base), "--budget", str(budget),
                                 "--format", "json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["budgets"][0]["actual"] == 0.0


def _corrupt_copy(store: Path, tmp: Path) -> Path:
    import shutil

    copy = tmp / "corrupt"
    shutil.copytree(store, copy)
    part = next((copy / "cand" / SPANS.name).rglob("part-*.parquet"))
    part.write_bytes(part.read_bytes()[:64])
    return copy


BAD_INPUT = [
    ("missing store", lambda s, t: [str(t / "nowhere")], "does not exist"),
    ("empty store", lambda s, t: [str(t)], "is empty"),
    ("unknown run", lambda s, t: [str(s), "--run", "nope"], "unknown run id 'nope'"),
    ("corrupt file", lambda s, t: [str(_corrupt_copy(s, t.parent))], "unreadable file"),
    ("unknown format", lambda s, t: [str(s), "--format", "pdf"], "unknown report format pdf"),
    ("two formats, no --out", lambda s, t: [str(s), "--format", "md,json"], "--out DIR is needed"),
    ("unknown baseline run", lambda s, t: [str(s), "--baseline", f"{s}:nope"], "unknown run id 'nope'"),
    ("baseline pattern matching no run", lambda s, t: [str(s), "--baseline", f"{s}:nightly-*"],
     "matches 'nightly-*'"),
    ("unknown candidate run", lambda s, t: [str(s), "--candidate", f"{s}:nope"], "unknown run id 'nope'"),
    ("too few A/A runs", lambda s, t: [str(s), "--baseline", str(s), "--noise", str(s)], "at least 3 A/A runs"),
    ("missing budget file", lambda s, t: [str(s), "--budget", str(t / "none.toml")], "does not exist"),
    ("malformed budget file", lambda s, t: [str(s), "--budget", str(_budget(t, "[budgets\n"))], "not valid TOML"),
    ("unknown metric", lambda s, t: [str(s), "--budget", str(_budget(t, 'budgets = ["ttft.p42 <= 1ms"]'))],
     "unknown metric 'ttft.p42'"),
    ("--out is a file", lambda s, t: [str(s), "--out", str(_budget(t, ""))], "File exists"),
    ("regression without baseline", lambda s, t: [str(s), "--budget",
                                                  str(_budget(t, 'budgets = ["regression.itl.p99 <= 5%"]'))],
     "pass --baseline"),
]


@pytest.mark.parametrize("case,args,expected", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_is_one_sentence_and_exit_2(planted_stores, tmp_path, case, args, expected):
    _, cand = planted_stores
    empty = tmp_path / "empty"
    empty.mkdir()
    result = runner.invoke(app, ["report", *args(cand, empty)])
    assert result.exit_code == 2, (case, result.output)
    assert result.stderr.startswith("error: ") and expected in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_a_run_without_requests_or_tokens_is_bad_input(engine_store, tmp_path):
    import shutil

    copy = tmp_path / "no-tokens"
    shutil.copytree(engine_store, copy)
    shutil.rmtree(copy / "real" / "tokens")
    result = runner.invoke(app, ["report", str(copy)])
    assert result.exit_code == 2 and "has no tokens rows: nothing to report" in result.stderr


def test_the_installed_entry_point_reports_bad_input_without_a_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "tokentrace.app.cli", "report", str(tmp_path / "nowhere")],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: store path {tmp_path / 'nowhere'} does not exist"
    assert "Traceback" not in done.stdout + done.stderr
