"""The ``tokentrace`` command line: --help, --version, runs, inspect, and bad input."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
from typer.testing import CliRunner

import tokentrace
from tokentrace.app.cli import app, format_bytes, format_ns
from tokentrace.schema import SPANS, STEPS, Role, col
from tokentrace.store import StoreWriter

REPO = Path(__file__).resolve().parents[4]
runner = CliRunner()


def rows(table, num_rows: int, **columns: list[int]) -> pa.RecordBatch:
    """``num_rows`` rows holding 0, 1, ... in every column but those given."""
    data = {n: list(range(num_rows)) for n in table.names}
    data.update(columns)
    return pa.RecordBatch.from_pydict(data)


@pytest.fixture()
def store(tmp_path: Path) -> Path:
    """Two runs: ``older`` (3 spans over 3 ns, dropped 4) and ``newer`` (2 steps in two files, 5 ms of spans)."""
    with StoreWriter(tmp_path, run_id="older") as w:
        w.write(SPANS, rows(SPANS, 3, **{col.START_NS: [1_000, 1_001, 1_002], col.END_NS: [1_001, 1_002, 1_003]}))
        w.update_counters({"dropped": 4, "sampled_out": 1})
    with StoreWriter(tmp_path, run_id="newer") as w:
        w.write(STEPS, rows(STEPS, 1))
        w.write(STEPS, rows(STEPS, 1))
        w.write(SPANS, rows(SPANS, 2, **{col.START_NS: [0, 10], col.END_NS: [10, 5_000_000]}))
        w.register_instance(77, Role.DECODE, "decode-7")
        w.update_counters({"dropped": 0, "sink_errors": 6})
    return tmp_path


def test_help_lists_the_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert "runs" in result.stdout and "inspect" in result.stdout


def test_version_prints_the_package_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.stdout.strip() == f"tokentrace {tokentrace.__version__}"


def test_runs_lists_every_run_with_rows_span_and_dropped(store):
    result = runner.invoke(app, ["runs", str(store)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert out.index("older") < out.index("newer")  # oldest first
    assert "spans 3" in out and "steps 2" in out and "spans 2" in out
    older_line = next(line for line in out.splitlines() if "older" in line)
    assert re.search(r"3 ns\s*│\s*4\s*│\s*1\s*│", older_line), older_line


def test_inspect_describes_the_newest_run_by_default(store):
    result = runner.invoke(app, ["inspect", str(store)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "run newer" in out and "older" not in out
    steps_line = next(line for line in out.splitlines() if "│ steps" in line)
    assert re.search(r"│\s*2\s*│\s*2\s*│", steps_line), steps_line  # 2 rows in 2 files
    assert "sink_errors" in out and "decode-7" in out and "decode" in out
    assert "time span: 5.0 ms" in out


def test_inspect_a_named_run(store):
    result = runner.invoke(app, ["inspect", str(store), "--run", "older"])
    assert result.exit_code == 0, result.output
    assert "run older" in result.stdout
    counters_line = next(line for line in result.stdout.splitlines() if "│ dropped" in line)
    assert counters_line.split("│")[2].strip() == "4"


def _bad_inputs(tmp_path: Path, store: Path) -> dict[str, list[str]]:
    (tmp_path / "empty").mkdir()
    (tmp_path / "notastore" / "photos").mkdir(parents=True)
    return {
        "does not exist": ["runs", str(tmp_path / "missing")],
        "is empty": ["runs", str(tmp_path / "empty")],
        "not a tokentrace store": ["inspect", str(tmp_path / "notastore")],
        "unknown run id 'nope'": ["inspect", str(store), "--run", "nope"],
    }


@pytest.mark.parametrize("expected", ["does not exist", "is empty", "not a tokentrace store", "unknown run id 'nope'"])
def test_bad_input_is_one_sentence_on_stderr_and_exit_2(tmp_path_factory, store, expected):
    args = _bad_inputs(tmp_path_factory.mktemp("bad"), store)[expected]
    result = runner.invoke(app, args)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert expected in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output


def test_an_unreadable_file_is_a_warning_line_not_a_failure(store):
    (part,) = sorted((store / "older" / SPANS.name).rglob("part-*.parquet"))
    part.write_bytes(b"garbage")
    result = runner.invoke(app, ["inspect", str(store), "--run", "older"])
    assert result.exit_code == 0
    assert result.stderr.startswith("warning: skipping unreadable store file") and part.name in result.stderr


def test_an_io_error_is_one_sentence_and_exit_2(store, monkeypatch):
    def denied(self):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "iterdir", denied)
    result = runner.invoke(app, ["runs", str(store)])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: cannot read {store}: Permission denied"
    assert "Traceback" not in result.output


def test_the_installed_entry_point_reports_bad_input_without_a_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    code = "from tokentrace.app.cli import main; main()"
    done = subprocess.run(
        [sys.executable, "-c", code, "inspect", str(tmp_path / "nowhere")], env=env, capture_output=True, text=True
    )
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: store path {tmp_path / 'nowhere'} does not exist"
    assert "Traceback" not in done.stdout + done.stderr


@pytest.mark.parametrize(
    "ns, text",
    [
        (None, "-"),
        (850, "850 ns"),
        (12_500, "12.5 µs"),
        (12_500_000, "12.5 ms"),
        (3_200_000_000, "3.20 s"),
        (7_500 * 10**9, "2 h 05 m"),
    ],
)
def test_format_ns(ns, text):
    assert format_ns(ns) == text


@pytest.mark.parametrize(
    "num, text", [(512, "512 B"), (12_595, "12.3 KiB"), (4 << 20, "4.0 MiB"), (3 << 40, "3072.0 GiB")]
)
def test_format_bytes(num, text):
    assert format_bytes(num) == text
