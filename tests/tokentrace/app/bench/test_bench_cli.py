"""``bench_command`` through typer: options, output formats, exit codes, scaling printout.

(Named test_bench_cli.py, not test_cli.py: tests/ has no __init__.py files, so test
module basenames must be unique and tests/tokentrace/test_cli.py exists.)
"""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from tokentrace.app.cli.commands.bench import EXIT_FAILED_REQUESTS, EXIT_USAGE, bench_command
from tokentrace.schema import REQUESTS, TOKENS, col
from tokentrace.store import open_run

app = typer.Typer()
app.command()(bench_command)
runner = CliRunner()

BASE = ["--max-requests", "6", "--input-len", "fixed:8", "--output-len", "fixed:3", "--duration", "20"]


def test_json_output_with_vllm_names_and_model_from_the_server(fake_url):
    r = runner.invoke(app, ["--url", fake_url, "--output", "json", "--endpoint", "chat", "--slo", "ttft=5s",
                            *BASE])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["completed"] == 6 and d["total_output_tokens"] == 18 and d["model"] == "ok"
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "p90_e2el_ms", "request_goodput",
                "output_throughput", "total_token_throughput"):
        assert key in d
    assert d["request_goodput"] > 0


def test_trace_scaling_is_printed_and_recorded(fake_url, tmp_path):
    r = runner.invoke(app, ["--url", fake_url, "--workload", "azure-code", "--time-scale", "0.01",
                            "--length-scale", "0.01", "--arrival", "trace", "--max-requests", "4",
                            "--store", str(tmp_path), "--run", "cli-run"])
    assert r.exit_code == 0, r.output
    assert "first 4 of 8819 requests, arrival times x0.01, lengths x0.01" in r.stdout
    assert "Successful requests:" in r.stdout and "cli-run" in r.stdout
    scaling = open_run(tmp_path, "cli-run").manifest["config"]["bench"]["scaling"]
    assert scaling["time_scale"] == 0.01 and scaling["num_requests_in_file"] == 8819


def test_failures_exit_non_zero_only_with_fail_on_error(fake_url):
    plain = runner.invoke(app, ["--url", fake_url, "--model", "http500", *BASE])
    assert plain.exit_code == 0 and "http_5xx:" in plain.stdout
    strict = runner.invoke(app, ["--url", fake_url, "--model", "cut", "--fail-on-error", *BASE])
    assert strict.exit_code == EXIT_FAILED_REQUESTS and "stream_cut:" in strict.stdout
    clean = runner.invoke(app, ["--url", fake_url, "--model", "ok", "--fail-on-error", *BASE])
    assert clean.exit_code == 0


def test_server_down_completes_and_counts(dead_url):
    r = runner.invoke(app, ["--url", dead_url, "--model", "m", "--output", "json", *BASE])
    assert r.exit_code == 0
    assert json.loads(r.stdout)["failures"]["connect"] == 6


@pytest.mark.parametrize("processes", ["0", "3"])
def test_the_summary_and_the_run_are_the_same_from_any_number_of_processes(fake_url, tmp_path, processes):
    r = runner.invoke(app, ["--url", fake_url, "--output", "json", "--processes", processes, "--store", str(tmp_path),
                            "--run", "p", "--rate", "50", "--slo", "ttft=5s", *BASE])
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert (d["num_prompts"], d["completed"], d["failed"], d["not_sent"]) == (6, 6, 0, 0)
    assert d["total_output_tokens"] == 18 and d["processes"] == int(processes)
    assert d["median_send_lag_ms"] is not None and d["request_goodput"] > 0
    # 6 requests x 2 gaps, from whichever process received them (0 when a busy machine delivered a
    # request's chunks in one read: they share its stamp)
    assert d["p99_itl_ms"] is not None and d["p99_itl_ms"] >= 0
    run = open_run(tmp_path, "p")
    assert len(run.instances()) == 1 and len(run.table(REQUESTS.name)) == 6 and len(run.table(TOKENS.name)) == 18


def test_bad_input_is_one_sentence_and_exit_2(fake_url):
    for args in (["--workload", "nope"], ["--tenants", "acme"], ["--slo", "ttft=fast"], ["--arrival", "zipf"],
                 ["--input-len", "normal:3"], ["--output", "xml"], ["--endpoint", "embeddings"],
                 ["--processes", "-1"], ["--processes", "3", "--concurrency", "2"], ["--url", "http://"]):
        r = runner.invoke(app, ["--url", fake_url, *args, "--max-requests", "1", "--duration", "5"])
        assert r.exit_code == EXIT_USAGE, args
        assert r.stderr.startswith("error: ") and "Traceback" not in r.output


def test_repeat_writes_one_run_per_repetition_that_a_comparison_reads(fake_url, tmp_path):
    import tokentrace

    r = runner.invoke(app, ["--url", fake_url, "--model", "ok", "--store", str(tmp_path), "--run", "aa",
                            "--repeat", "3", *BASE])
    assert r.exit_code == 0, r.output
    assert [line for line in r.stdout.splitlines() if line.startswith("run ")][:3] == [
        "run 1 of 3: aa-1", "run 2 of 3: aa-2", "run 3 of 3: aa-3"]
    keys = [set(open_run(tmp_path, f"aa-{i}").table(REQUESTS.name).column(col.REQUEST_KEY).to_pylist())
            for i in (1, 2, 3)]
    assert all(len(k) == 6 for k in keys) and not (keys[0] & keys[1]) and not (keys[1] & keys[2])
    runs = [tokentrace.open(tmp_path, f"aa-{i}") for i in (1, 2, 3)]
    df = runs[0].analyze().compare([runs[1], runs[2]])  # the client's view of each run, tested run against run
    row = df.set_index(["metric", "statistic"]).loc[("ttft", "mean")]
    assert row["runs_baseline"] == 2 and row["runs_candidate"] == 1 and row["n_candidate"] == 6
    assert row["noise_source"].startswith("default: A/A runs")


def test_repeat_must_be_positive(fake_url):
    r = runner.invoke(app, ["--url", fake_url, "--repeat", "0", *BASE])
    assert r.exit_code == EXIT_USAGE and "--repeat must be at least 1" in r.output
