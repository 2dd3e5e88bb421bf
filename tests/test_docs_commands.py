"""Every shell command in README.md and docs/*.md runs as written, here or in a named test.

The shell blocks (```bash / ```sh / ```shell) of the user documentation are
extracted; each one must appear in :data:`COVERAGE`, keyed by the file and the
block's first line, either

* ``RUN``: this test runs the whole block with bash in a scratch folder that
  holds what the docs assume (the venv's ``tokentrace`` and ``python`` first on
  PATH, ``.venv`` linked to it, the real-run fixture as ``traces/``,
  ``demo-store/``, ``stores/ci`` and ``stores/main``, and any file a doc says
  to "save as"), and checks its exit status; or
* ``Covered(test, why)``: a command that cannot run here (the set-up commands,
  which CI itself runs; long-running servers; a third-party server) and the
  test that exercises the same path, which must exist.

A new or edited block without an entry fails :func:`test_every_shell_block_is_covered`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FIXTURE_RUN = REPO / "tests" / "data" / "real_run" / "mooncake-disagg"
STORES = ("traces", "demo-store", "stores/ci", "stores/main")  # store folders the docs' commands name
SHELL_FENCE = re.compile(r"```(?:bash|sh|shell)\n(.*?)```", re.S)
PYTHON_FENCE = re.compile(r"save as\s*`([\w.-]+\.py)`\)?:?\s*```python\n(.*?)```", re.S)
TOML_FENCE = re.compile(r"```toml\n(.*?)```", re.S)


@dataclass(frozen=True, slots=True)
class Covered:
    """The block is exercised by ``test`` (``path::name``) because ``why``."""

    test: str
    why: str


@dataclass(frozen=True, slots=True)
class Run:
    """Run the block here; its exit status must be one of ``codes``."""

    codes: tuple[int, ...] = (0,)
    timeout_s: float = 120.0


RUN = Run()

COVERAGE: dict[tuple[str, str], Run | Covered] = {
    ("README.md", "python3 -m venv .venv && .venv/bin/pip install --progress-bar on -c constraints.txt -e "
                  "'.[server,dashboard]' && .venv/bin/tokentrace demo"): Covered(
        "tests/test_demo.py::test_every_role_of_the_deployment_is_traced_into_one_run",
        "set-up: CI creates the venv with the same pip line (tests/test_readme.py); the demo itself, reduced, "
        "is tests/test_demo.py, and with the dashboard it runs until Ctrl-C"),
    ("README.md", "python3 -m venv .venv && .venv/bin/pip install -q -c constraints.txt -e "
                  "'.[server,dashboard,test,spark]' && .venv/bin/python -m pytest -q -n 2 --dist loadgroup -m \"not serial\" "
                  "&& .venv/bin/python -m pytest -q -m serial"): Covered(
        "tests/test_readme.py::test_ci_runs_exactly_the_readme_test_command",
        "this is the command CI runs (.ci/run); running it here would run the suite inside itself"),
    ("README.md", ".venv/bin/tokentrace runs traces/"): RUN,
    ("docs/instrument-otel.md", "python toy_server.py &"): Covered(
        "tests/instrument/test_asgi.py::test_streaming_request_records_every_chunk_usage_and_receive",
        "starts a server on the fixed port 8000 in the background; the middleware on a streaming app is "
        "tested in-process"),
    ("docs/instrument-otel.md", "tokentrace ingest-otlp --listen 127.0.0.1:4318 --store traces --run vllm-run-1"):
        Covered("tests/instrument/test_otel.py::test_receiver_ingests_protobuf_and_json_and_survives_bad_payloads",
                "a long-running receiver, then `vllm serve`, a third-party GPU server not installed here"),
    ("docs/instrument-serving.md", "tokentrace run --store traces -- python -m reference_server --mode disagg "
                                   "--prefill 1 --decode 2"): Covered(
        "tests/instrument/test_reference_serving.py::test_disaggregated_cluster_with_a_skewed_worker_clock",
        "a long-running server; the second line traces the user's own my_server.py "
        "(tests/tokentrace/app/cli/commands/test_run.py covers --run and --sample)"),
    ("docs/whatif.md", "tokentrace whatif traces --set rate_scale=1.5"): Run(timeout_s=300.0),
    ("docs/diagnosis.md", "tokentrace why traces/"): RUN,
    ("docs/report.md", "tokentrace report stores/ci --baseline stores/main --budget tokentrace.toml \\"):
        Run(codes=(0, 1)),  # exit 1 = a budget failed, which is what the CI step reports
    ("docs/instrumenting.md", "tokentrace run --store traces --run disagg -- python -m reference_server --mode "
                              "disagg --prefill 1 --decode 1 --model tiny --port 8000"): Covered(
        "tests/test_demo.py::test_every_role_of_the_deployment_is_traced_into_one_run",
        "a long-running server; the demo starts the same command (tokentrace run around a disaggregated "
        "reference server) and stops it with SIGINT"),
    ("docs/instrumenting.md", "tokentrace bench --url http://127.0.0.1:8000 --workload mooncake --max-requests 10 "
                              "--length-scale 0.015625 --store traces --run disagg"): Covered(
        "tests/test_demo.py::test_server_ttft_and_itl_agree_with_the_client",
        "needs the server of the previous block; the demo replays Mooncake through the same bench machinery "
        "into the server's run and the report is read from it"),
    ("docs/instrumenting.md", "python my_engine.py && tokentrace report traces --run my-engine"): RUN,
    ("docs/instrumenting.md", "python hf_server.py"): Covered(
        "tests/instrument/test_hf_transformers.py::"
        "test_the_documented_fastapi_transformers_server_traces_every_stage_of_every_token",
        "a long-running server on the fixed port 8000; the test serves the doc's own hf_server.py on a free "
        "port, streams concurrent requests through it and checks every stage and the attribution"),
    ("docs/instrumenting.md", "tokentrace bench --url http://127.0.0.1:8000 --sessions agent --num-sessions 4 "
                              "--length-scale 0.25 --processes 0 --store traces --run agent-keep"): Covered(
        "tests/tokentrace/app/bench/test_sessions.py::test_agent_sessions_on_the_reference_server_record_sessions_and_full_reuse",
        "needs the server of the block before; the test runs agent sessions against a reference server that keeps "
        "sessions' KV, and tests/tokentrace/app/report/test_sessions.py::test_retention_policies_compared_run_against_run "
        "compares two retention policies with --baseline"),
    ("docs/quickstart.md", "tokentrace demo --sessions agent --num-sessions 6 --kv-retention keep --no-dashboard"):
        Covered("tests/tokentrace/app/demo/test_sessions.py::test_the_demo_runs_agent_sessions_on_the_disaggregated_server",
                "starts a disaggregated server for about a minute; the test runs the same path reduced (one "
                "session, the tiny model)"),
    ("docs/instrument-otel.md", "tokentrace ingest-otlp --grpc-listen 127.0.0.1:4317 --store traces --run vllm-run-1"):
        Covered("tests/instrument/test_otel.py::test_grpc_receiver_takes_vllms_default_exporter_beside_http_into_one_run",
                "a long-running receiver, then `vllm serve`, a third-party GPU server not installed here; the test "
                "sends through the OTLP/gRPC exporter vLLM uses, configured as vLLM configures it"),
    ("docs/instrumenting.md", "tokentrace ingest-otlp --grpc-listen 127.0.0.1:4317 --store traces --run vllm-1"): Covered(
        "tests/instrument/test_otel.py::test_grpc_receiver_takes_vllms_default_exporter_beside_http_into_one_run",
        "a long-running receiver on fixed ports; the test starts the same receiver on free ports"),
    ("docs/instrumenting.md", "OTEL_EXPORTER_OTLP_TRACES_INSECURE=true vllm serve meta-llama/Llama-3.2-1B-Instruct "
                              "--otlp-traces-endpoint grpc://127.0.0.1:4317"): Covered(
        "tests/instrument/test_otel.py::test_grpc_receiver_takes_vllms_default_exporter_beside_http_into_one_run",
        "vLLM is a third-party GPU server, not a dependency; the receiver is tested with vLLM's default "
        "exporter (OTLP/gRPC, gzip, insecure) sending vLLM's llm_request attributes"),
    ("docs/quickstart.md", "tokentrace demo --no-dashboard"): Covered(
        "tests/test_demo.py::test_the_report_is_printed",
        "the full demo runs for minutes; the test runs the same code path reduced (10 requests, tiny model)"),
    ("docs/quickstart.md", "tokentrace demo --speculative --no-dashboard"): Covered(
        "tests/test_demo.py::test_the_speculative_flag_reaches_the_servers_own_options",
        "the full demo runs for most of a minute; the test runs the flag through the CLI into the server's argv and "
        "the reference server's own argument parser, and test_the_terminal_report_shows_speculation_only_when_the_"
        "run_speculated prints the section the demo prints"),
    ("docs/quickstart.md", "tokentrace runs demo-store"): RUN,
    ("docs/quickstart.md", "tokentrace dashboard demo-store --port 8050"): Covered(
        "tests/dashboard/test_command.py::test_binds_loopback_by_default",
        "serves until Ctrl-C; tests/test_demo.py::test_the_dashboard_step_serves_the_store_until_ctrl_c "
        "serves the real-run fixture and stops it with SIGINT"),
    ("docs/scaling.md", "python - <<'EOF'"): RUN,
    ("docs/instrument-otel.md", "tokentrace export traces --format otlp --endpoint http://127.0.0.1:4318/v1/traces"):
        Covered("tests/instrument/test_otlp_mapping.py::test_export_command_to_a_running_ingest_otlp_reproduces_the_run",
                "needs a receiver on a fixed port; the test runs the same command against a tokentrace ingest-otlp "
                "on a free port and checks the run comes back whole"),
    ("docs/instrument-otel.md", "tokentrace ingest-client profile_export.jsonl --format aiperf --store traces "
                                "--run aiperf-run"):
        Covered("tests/tokentrace/app/clients/test_importers.py::test_report_shows_the_agreement_of_an_imported_aiperf_run",
                "needs an AIPerf export of a run in the store; the test imports a real AIPerf 0.13 export into the "
                "store the reference server wrote for it, then runs tokentrace report on it"),
    ("docs/instrument-otel.md", "tokentrace run --store traces --metrics-port 9400 -- python -m reference_server "
                                "--model tiny --port 8000"):
        Covered("tests/tokentrace/test_live_metrics.py::test_tokentrace_run_metrics_port_reaches_the_traced_process",
                "a long-running server on fixed ports; the test runs tokentrace run --metrics-port around a traced "
                "process on a free port and parses what its /metrics serves"),
    ("docs/scaling.md", ".venv/bin/pip install -c constraints.txt -e '.[spark]' && sudo apt-get install -y "
                        "default-jre-headless"): Covered(
        "tests/test_readme.py::test_ci_runs_the_spark_tests_with_java_never_skipping_them",
        "set-up: CI's test command installs the same extra and .ci/run installs Debian's Java first"),
    ("docs/scaling.md", "tokentrace report traces --engine spark --spark-master 'local[2]' --format json --out "
                        "spark-report"): Covered(
        "tests/analyzers/test_engines.py::test_the_report_on_the_real_run_is_the_same_on_both_engines",
        "starts a JVM, most of a minute on two busy cores; the test makes the same report of the same real run "
        "on Spark and compares every table and metric with DuckDB's, and the command's error paths run there too"),
    ("docs/scaling.md", "ls \"$(python -c 'import os, pyspark; print(os.path.dirname(pyspark.__file__))')/jars\" | "
                        "grep hadoop-client-api"): RUN,
    ("docs/scaling.md", "spark-submit --master spark://head:7077 --packages org.apache.hadoop:hadoop-aws:3.5.0 \\"):
        Covered("tests/analyzers/test_engines.py::test_groupings_and_cache_on_a_simulated_run_read_by_url",
                "needs a Spark cluster and an S3 bucket; the test reads a run by its URL through the same "
                "Source.of_url (file://, the same Hadoop file system path) and compares with DuckDB"),
    ("docs/reference-server.md", ".venv/bin/python -m reference_server.model.train --out reference_server/weights"):
        Covered("tests/reference_server/model/test_train.py::test_the_training_command_writes_checkpoints_the_engine_loads",
                "trains for about 20 minutes; the test runs the same command for 2 steps into a scratch folder and "
                "serves what it wrote"),
    ("docs/reference-server.md", "tokentrace run --store traces --run spec -- python -m reference_server --mode "
                                 "colocated --instances 1 --model trained --speculative ngram --port 8000"): Covered(
        "tests/instrument/test_speculative_tracing.py::test_colocated_cluster_with_speculation_under_tokentrace_run",
        "a long-running server on a fixed port; the test runs tokentrace run around a colocated reference server "
        "with --speculative ngram on a free port and checks the tiling of its speculative steps"),
    ("docs/reference-server.md", ".venv/bin/python benchmarks/speculative.py"): Covered(
        "tests/benchmarks/test_speculative.py::test_the_benchmark_prints_its_table_and_ratio_last",
        "takes minutes; the test runs it reduced (tiny model, batches 1 and 2) and checks its table and last line"),
    ("docs/scaling.md", "tokentrace run --store traces --sample 0.1 -- python -m reference_server --mode disagg "
                        "--prefill 1 --decode 1 --port 8000"): Covered(
        "tests/tokentrace/app/cli/commands/test_run.py::test_command_gets_the_environment_and_its_exit_status_is_returned",
        "a long-running server; that test checks --sample reaches every traced process, tests/test_demo.py "
        "runs tokentrace run around the disaggregated server"),
}


@dataclass(frozen=True, slots=True)
class Block:
    file: str  # relative to the repository root
    text: str

    @property
    def first_line(self) -> str:
        return self.text.strip().splitlines()[0].strip()

    @property
    def id(self) -> str:
        return f"{self.file}:{self.first_line[:60]}"


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def shell_blocks() -> list[Block]:
    out = []
    for path in doc_files():
        for m in SHELL_FENCE.finditer(path.read_text(encoding="utf-8")):
            if m.group(1).strip():
                out.append(Block(str(path.relative_to(REPO)), m.group(1)))
    return out


BLOCKS = shell_blocks()
RUN_BLOCKS = [b for b in BLOCKS if isinstance(COVERAGE.get((b.file, b.first_line)), Run)]


def test_every_shell_block_is_covered():
    missing = [b.id for b in BLOCKS if (b.file, b.first_line) not in COVERAGE]
    assert not missing, ("shell blocks with no entry in COVERAGE (run them here or name the test that "
                         "covers them):\n" + "\n".join(missing))
    assert len(BLOCKS) >= 10


def test_allow_listed_blocks_name_tests_that_exist():
    for (file, first), entry in COVERAGE.items():
        if not isinstance(entry, Covered):
            continue
        path, _, name = entry.test.partition("::")
        source = REPO / path
        assert source.is_file(), f"{file}: {first!r} names {entry.test}, whose file is missing"
        assert re.search(rf"^def {re.escape(name)}\(", source.read_text(encoding="utf-8"), re.M), \
            f"{file}: {first!r} names {entry.test}, which does not exist"
        assert entry.why


def test_no_entry_is_stale():
    present = {(b.file, b.first_line) for b in BLOCKS}
    stale = [f"{f}: {line}" for f, line in COVERAGE if (f, line) not in present]
    assert not stale, "COVERAGE entries whose block is gone from the docs:\n" + "\n".join(stale)


def _venv_bin() -> Path:
    """The folder of this interpreter: the venv's bin, holding ``tokentrace`` and ``python``."""
    return Path(sys.executable).parent


def _scratch(tmp_path: Path, doc: Path) -> Path:
    """A folder holding what the docs' commands assume."""
    work = tmp_path / "work"
    work.mkdir()
    (work / ".venv").mkdir()
    (work / ".venv" / "bin").symlink_to(_venv_bin(), target_is_directory=True)
    for store in STORES:
        shutil.copytree(FIXTURE_RUN, work / store / FIXTURE_RUN.name)
    text = doc.read_text(encoding="utf-8")
    for name, body in PYTHON_FENCE.findall(text):
        (work / name).write_text(body, encoding="utf-8")
    toml = TOML_FENCE.findall(text)
    if toml:
        (work / "tokentrace.toml").write_text(toml[0], encoding="utf-8")
    return work


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=[b.id for b in RUN_BLOCKS])
def test_command_runs_as_written(block: Block, tmp_path: Path):
    entry = COVERAGE[(block.file, block.first_line)]
    assert isinstance(entry, Run)
    work = _scratch(tmp_path, REPO / block.file)
    env = {**os.environ, "PATH": f"{_venv_bin()}{os.pathsep}{os.environ.get('PATH', '')}",
           "GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md"), "PYTHONPATH": str(REPO)}
    proc = subprocess.run(["bash", "-c", block.text], cwd=work, env=env, capture_output=True, text=True,
                          timeout=entry.timeout_s)
    assert proc.returncode in entry.codes, f"{block.id} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n" \
                                           f"{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stdout.strip() or (tmp_path / "summary.md").is_file(), f"{block.id} printed nothing"
