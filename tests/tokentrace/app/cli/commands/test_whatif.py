"""``tokentrace whatif`` on the real disaggregated fixture run (schema 3: no recorded engine configuration)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tokentrace.app.cli import app, register_commands

REPO = Path(__file__).resolve().parents[5]
STORE = REPO / "tests" / "data" / "real_run"
register_commands()
runner = CliRunner()
LATENCY = ("ttft.p50", "ttft.p99", "itl.p50", "itl.p99", "e2e.p50", "e2e.p99")


def _json(*args: str) -> dict:
    result = runner.invoke(app, ["whatif", str(STORE), *args, "--format", "json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_json_carries_predicted_fitted_and_fit_error_under_the_report_metric_names():
    doc = _json("--set", "rate_scale=1.5", "--set", "decode_instances=2")
    report = json.loads(runner.invoke(app, ["report", str(STORE), "--format", "json"]).stdout)["metrics"]
    for key in ("predicted", "fitted", "measured"):
        assert set(LATENCY) | {"slo.all.attainment", "load.served_rps"} <= set(doc[key])
    for name in LATENCY + ("slo.all.attainment",):
        assert name in report  # the same names as the report's metrics
        assert doc["measured"][name] == pytest.approx(report[name], rel=1e-9)  # measured as the report does
    assert doc["settings"] == {"rate_scale": 1.5, "decode_instances": 2}
    assert all(abs(doc["fit_error"][m]) < 1.0 for m in LATENCY)  # within a factor of two on its own run
    assert doc["fit_error"]["step_time.mape"] > 0
    assert any("engine_configs" in n for n in doc["notes"])  # schema 3: limits read off the steps
    assert [e["role"] for e in doc["model"]["engines"]] == ["prefill", "decode"]


def test_more_load_predicts_more_queueing_and_a_second_decode_instance_less():
    base = _json()
    busier = _json("--set", "rate_scale=3")
    assert busier["predicted"]["ttft.p99"] > base["predicted"]["ttft.p99"]
    assert busier["predicted"]["load.served_rps"] > base["predicted"]["load.served_rps"]
    assert base["predicted"] == base["fitted"]  # no change: the prediction is the replay of the run


def test_a_slower_device_predicts_longer_latency_and_the_model_names_its_step_time_form():
    base = _json()
    slow = _json("--set", "step_time_scale=2")
    for m in ("itl.p50", "e2e.p50"):
        assert slow["predicted"][m] > 1.5 * base["predicted"][m], (m, slow["predicted"][m], base["predicted"][m])
    for step in base["model"]["step_time"].values():
        assert step["form"] in ("linear", "log", "piecewise") and step["seqs_covered"][0] >= 1
        if step["heldout_error"]:
            assert step["form"] in step["heldout_error"]


def test_text_says_it_in_sentences():
    result = runner.invoke(app, ["whatif", str(STORE), "--set", "max_num_seqs=2"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "Fitted to run mooncake-disagg" in out and "Replaying the run itself" in out
    assert "With max_num_seqs=2: ttft.p50" in out


def test_sweep_prints_the_curve_and_the_highest_rate_meeting_the_slo():
    result = runner.invoke(app, ["whatif", str(STORE), "--sweep", "rate_scale=0.25:1:0.25"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["rate_scale", "ttft.p50"])
    assert [line.split()[0] for line in lines[header + 1:header + 5]] == ["0.25", "0.5", "0.75", "1"]
    assert "e+" not in result.stdout  # no scientific notation for people
    assert "rate_scale" in lines[-1] and ("highest" in lines[-1] or "No rate_scale" in lines[-1])
    doc = json.loads(runner.invoke(app, ["whatif", str(STORE), "--sweep", "max_num_seqs=1,4,16",
                                         "--format", "json"]).stdout)
    assert [p["value"] for p in doc["sweep"]["points"]] == [1, 4, 16]


@pytest.mark.parametrize("args, message", [
    (["--set", "warp=2"], "unknown setting 'warp'"),
    (["--set", "rate_scale=fast"], "rate_scale must be a number"),
    (["--set", "rate_scale=-1"], "rate_scale must be a positive number"),
    (["--set", "step_time_scale=0"], "step_time_scale must be a positive number"),
    (["--set", "max_num_seqs=2.5"], "max_num_seqs must be an integer >= 1"),
    (["--set", "scheduling_policy=lifo"], "scheduling_policy must be one of fcfs, slo, fair"),
    (["--set", "rate_scale"], "--set takes NAME=VALUE"),
    (["--set", "instances=2", "--set", "decode_instances=2"], "exclude each other"),
    (["--sweep", "rate_scale=2:1:0.5"], "START <= STOP"),
    (["--sweep", "rate_scale=0.5:1:0.5", "--set", "rate_scale=2"], "both swept and set"),
    (["--format", "yaml"], "unknown format"),
    (["--run", "nope"], "nope"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = runner.invoke(app, ["whatif", str(STORE), *args])
    assert result.exit_code == 2, result.output
    err = result.stderr.strip()
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1
    assert "Traceback" not in result.output


def test_a_missing_store_is_exit_2(tmp_path):
    result = runner.invoke(app, ["whatif", str(tmp_path / "missing")])
    assert result.exit_code == 2 and result.stderr.startswith("error: ")
