"""`tokentrace demo`, reduced (10 requests, no dashboard), end to end.

The demo starts the reference server disaggregated under `tokentrace run`,
replays the head of the Mooncake trace (shipped in tests/data) with three
tenants and two SLO classes, stops the server and prints the report. This test
runs exactly that path, so the newcomer's first command cannot silently rot,
and checks what the issue promises: every role traced into one run, the report
printed, the server's TTFT and ITL consistent with the client's own
measurements, and (separately) the unattributed share under 1%.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from rich.console import Console
from typer.testing import CliRunner

import tokentrace
from analyzers.agreement import CLIENT_NS, DIFF_NS, itl_agreement, ttft_agreement
from tokentrace.app.cli import app, register_commands
from tokentrace.app.demo import DemoOptions, run_demo
from tokentrace.app.demo.server import ServerSpec, ServerStartError, TracedServer, server_command
from tokentrace.schema import INSTANCES, REQUESTS, SPANS, TOKENS, Role, Stage, col

pytestmark = pytest.mark.timeout(300)

DATA = Path(__file__).resolve().parent / "data"
TRACE = DATA / "mooncake_conversation_head100.jsonl"
NUM_REQUESTS = 10  # the trace's first 10 requests: they arrive together
TTFT_CLOCK_SLACK_NS = 1_000_000  # cross-process clock alignment error we accept, 1 ms
ITL_MEDIAN_BOUND_NS = 2_000_000  # median |server - client| ITL, 2 ms


def _reduced(store: Path, **kw: object) -> DemoOptions:
    # The demo's own model ("small"), not "tiny": with a tiny model's ~1 ms steps, the fixed cost of each
    # cross-process hand-over (a fraction of a millisecond no stage owns) is ~5% of token latency.
    base = dict(store=store, num_requests=NUM_REQUESTS, model="small", trace=TRACE, dashboard=False,
                run="reduced", device="cpu", load_duration_s=60.0, load_drain_s=30.0)
    base.update(kw)
    return DemoOptions(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory):
    store = tmp_path_factory.mktemp("demo") / "demo-store"
    out = io.StringIO()
    result = run_demo(_reduced(store), console=Console(file=out, width=160, force_terminal=False))
    return result, out.getvalue(), store


def _tables(store: Path, run_id: str):
    run = tokentrace.open(store, run=run_id)
    return run, [run.table(t.name) for t in (REQUESTS, TOKENS, INSTANCES)], run.table(SPANS.name)


def test_every_role_of_the_deployment_is_traced_into_one_run(demo):
    result, _, store = demo
    run, _, _ = _tables(store, result.run_id)
    roles = {Role.from_label(i["role"]) for i in run.instances()}
    assert roles == {Role.CLIENT, Role.GATEWAY, Role.PREFILL, Role.DECODE}
    assert result.num_sent == result.num_ok == NUM_REQUESTS
    # every traced process flushed and closed its writer (the server was stopped, not killed)
    fragments = sorted((result.run_path / "manifest.d").glob("*.json"))
    assert len(fragments) == 4
    assert all(json.loads(f.read_text())["closed"] for f in fragments)
    assert result.server_exit is not None


def test_the_tenants_analysis_uses_the_servers_scheduling_weights(demo):
    from tokentrace.app.demo.load import DEMO_TENANTS

    result, _, store = demo
    run, _, _ = _tables(store, result.run_id)
    shares = run.analyze().tenants().shares.set_index(col.TENANT)
    for t in DEMO_TENANTS:
        if t.name in shares.index:
            assert shares.loc[t.name, "weight"] == t.weight


def test_server_workers_recorded_prefill_and_decode_work(demo):
    result, _, store = demo
    run, _, spans = _tables(store, result.run_id)
    by_role = {i["instance"]: Role.from_label(i["role"]) for i in run.instances()}
    span_roles = {by_role.get(i) for i in set(spans.column(col.INSTANCE_ID).to_pylist())}
    assert {Role.GATEWAY, Role.PREFILL, Role.DECODE} <= span_roles


def test_the_report_is_printed(demo):
    result, text, store = demo
    for step in range(1, 6):
        assert f"[{step}/6]" in text
    assert f"{NUM_REQUESTS} requests traced by 4 processes" in text  # requests, not request rows
    assert not re.search(r"\d{15,}", text), "a 63-bit id reached the terminal"
    assert "server exited with status 0 (clean: every process flushed)" in text  # what docs/quickstart.md says
    for title in ("Latency (server view)", "Where the time went", "Client and server agreement", "Checks"):
        assert title in text
    assert "unattributed time:" in text and "overlap" in text and "ITL server - client" in text
    slo = result.report.headline[0]  # why before how loaded, as in `tokentrace report`
    assert slo == result.report.diagnosis["verdict"] and slo.split(":")[0] in ("SLO MISSED", "SLO met"), slo
    verdict = result.report.load["verdict"]
    assert verdict.split(":")[0] in ("SATURATED", "Not saturated", "Load not judged"), verdict
    assert text.index(slo[:30]) < text.index(verdict[:40]) < text.index("Latency (server view)")
    assert str(result.run_path) in text
    assert f"tokentrace dashboard {store} --port 8050" in text  # --no-dashboard: the command to run instead
    assert result.report.metrics["ttft.p50"] > 0


def test_server_ttft_and_itl_agree_with_the_client(demo):
    """Causality on one host: the client sends before the gateway sees the request and
    receives after the gateway sent, so server TTFT <= client TTFT; ITLs are the same
    gaps seen from both ends, so their median difference is small."""
    result, _, store = demo
    _, tables, spans = _tables(store, result.run_id)
    ttft = ttft_agreement(*tables, spans)
    assert len(ttft) == NUM_REQUESTS
    # The gateway stamps a chunk as sent when its write call returns; on a busy machine that
    # return can come well after the bytes left (another thread holds the GIL), so causality
    # holds from the write's start: the server's TTFT less its first chunk's write time.
    writes = spans.to_pandas()
    writes = writes[(writes[col.STAGE] == int(Stage.STREAM_SEND)) & (writes[col.TOKEN_INDEX] >= 0)]
    first_write = writes.sort_values(col.END_NS).groupby(col.REQUEST_ID).first()
    write_ns = (first_write[col.END_NS] - first_write[col.START_NS]).reindex(ttft[col.REQUEST_ID]).fillna(0)
    late = ttft[DIFF_NS].to_numpy() - write_ns.to_numpy()
    assert (late <= TTFT_CLOCK_SLACK_NS).all(), ttft.assign(write_ns=write_ns.to_numpy())[[CLIENT_NS, DIFF_NS, "write_ns"]]
    itl = itl_agreement(*tables, spans)
    assert len(itl) > NUM_REQUESTS
    assert abs(float(itl[DIFF_NS].median())) < ITL_MEDIAN_BOUND_NS


def test_unattributed_share_is_under_one_percent(demo):
    result, _, _ = demo
    share = result.report.metrics["unattributed.share"]
    assert abs(share) < 0.01, f"unattributed {share:.2%} of token latency"


def test_no_process_of_the_server_is_left(demo):
    result, text, _ = demo
    pgid = int(re.search(r"process group (\d+)", text).group(1))
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


QUICKSTART = Path(__file__).resolve().parents[1] / "docs" / "quickstart.md"


def test_the_quickstart_quotes_what_the_demo_prints(demo):
    """docs/quickstart.md's table of steps quotes the demo's own lines (step 1's port check needs the dashboard,
    which the reduced demo leaves out, so its line is checked against the code that prints it)."""
    _, text, _ = demo
    doc = QUICKSTART.read_text(encoding="utf-8")
    for quoted in ("output tokens each on average", "server exited with status 0 (clean: every process flushed)",
                   "0 failed or cut", "requests traced by 4 processes"):
        assert quoted in text, quoted
        assert quoted in doc, quoted
    assert "status 130" not in doc
    source = (Path(__file__).resolve().parents[1] / "tokentrace" / "app" / "demo" / "__init__.py").read_text()
    assert "is free (checked now, before the load)" in source and "dashboard port 8050 on 127.0.0.1 is free" in doc


def test_requests_produce_enough_tokens_to_time_each_one(demo):
    """At least 16 output tokens per request on average, planned (printed) and delivered to the client."""
    result, text, store = demo
    planned = float(re.search(r"([\d.]+) output tokens each on average", text).group(1))
    assert planned >= 16
    from analyzers.capacity import throughput_summary

    run, _, _ = _tables(store, result.run_id)
    delivered = throughput_summary(run.analyze().source).iloc[0]  # tokens the server delivered, by its own rows
    assert delivered["num_requests"] == NUM_REQUESTS and delivered[col.NUM_OUTPUT_TOKENS] / NUM_REQUESTS >= 16


def test_the_default_load_has_enough_tokens_and_says_so_when_saturated():
    from tokentrace.app.demo.load import LoadSpec, build_load_plan, mean_output_tokens
    from tokentrace.app.demo.report import saturation_lines

    opts = DemoOptions()
    spec = LoadSpec(trace=TRACE, num_requests=opts.num_requests, time_scale=opts.time_scale,
                    length_scale=opts.length_scale, output_scale=opts.output_scale, block_size=opts.block_size)
    plan = build_load_plan(spec, key_prefix="t")
    assert mean_output_tokens(plan) >= 16
    assert max(len(r.text.prompt) for r in plan.requests) < 2048  # prompts stay CPU-sized

    class Saturated:
        load = {"saturated": True, "pool": "decode"}

    (line,) = saturation_lines(Saturated(), time_scale=1.0)
    assert "saturated" in line and "decode" in line and "--time-scale 2" in line
    Saturated.load = {"saturated": False}
    assert saturation_lines(Saturated()) == []


def test_a_dashboard_port_in_use_is_refused_before_any_load(tmp_path):
    register_commands()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        start = time.monotonic()
        result = CliRunner().invoke(app, ["demo", "--store", str(tmp_path / "st"), "--trace", str(TRACE),
                                          "--port", str(port), "--requests", "2"])
    assert result.exit_code == 2, result.output
    assert f"port {port} on 127.0.0.1 is in use" in result.output and "--no-dashboard" in result.output
    assert time.monotonic() - start < 30  # before the server starts and the load runs, not after minutes
    assert not (tmp_path / "st").exists()


def test_server_command_traces_a_disaggregated_server():
    spec = ServerSpec(store=Path("st"), run_id="r", tenants_file=Path("t.json"), model="tiny")
    argv = server_command(spec)
    run_at = argv.index("run")
    assert argv[run_at - 2:run_at] == ["-m", "tokentrace.app.cli"]
    assert argv[run_at + 1:argv.index("--")] == ["--store", "st", "--run", "r"]
    server = argv[argv.index("--") + 1:]
    assert server[1:3] == ["-m", "reference_server"]
    for flag, value in (("--mode", "disagg"), ("--prefill", "1"), ("--decode", "1"), ("--port", "0"),
                        ("--tenants", "t.json"), ("--model", "tiny")):
        assert server[server.index(flag) + 1] == value


def _spec(tmp_path: Path) -> ServerSpec:
    return ServerSpec(store=tmp_path / "st", run_id="r", tenants_file=tmp_path / "t.json", model="tiny")


def test_a_server_that_exits_before_ready_is_reported_with_its_stderr(tmp_path):
    crash = [sys.executable, "-c", "import sys; print('no such model: huge', file=sys.stderr); sys.exit(2)"]
    server = TracedServer(_spec(tmp_path), log_path=tmp_path / "server.log", command=crash)
    with pytest.raises(ServerStartError, match=r"exited \(status 2\)[\s\S]*no such model: huge"):
        server.start(timeout_s=60)
    assert not server.running()


def test_a_server_that_never_gets_ready_is_stopped(tmp_path):
    hang = [sys.executable, "-c", "import sys, time; print('loading', flush=True); time.sleep(120)"]
    server = TracedServer(_spec(tmp_path), log_path=tmp_path / "server.log", command=hang)
    with pytest.raises(ServerStartError, match="no READY line within 1 s"):
        server.start(timeout_s=1)
    assert not server.running()
    with pytest.raises(ProcessLookupError):
        os.killpg(server.pid, 0)


def test_a_server_that_ignores_sigint_is_killed_after_the_grace_period(tmp_path):
    stubborn = [sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                                      "print('READY http://127.0.0.1:9', flush=True); time.sleep(120)"]
    server = TracedServer(_spec(tmp_path), log_path=tmp_path / "server.log", command=stubborn)
    assert server.start(timeout_s=60) == "http://127.0.0.1:9"
    assert server.stop(grace_s=0.5) == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.killpg(server.pid, 0)


def test_missing_trace_is_one_sentence_and_exit_2(tmp_path):
    register_commands()
    result = CliRunner().invoke(app, ["demo", "--store", str(tmp_path / "st"), "--trace",
                                      str(tmp_path / "nope.jsonl"), "--no-dashboard"])
    assert result.exit_code == 2
    assert "trace file not found" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "st").exists()


def _default_sigint() -> None:
    """Give the child the SIGINT disposition a user's terminal gives: a test runner started as a
    background job (as a CI harness may be) hands an ignored SIGINT down to its children."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_the_load_stops_everything_and_leaves_a_readable_store(tmp_path):
    store = tmp_path / "st"
    cmd = [sys.executable, "-m", "tokentrace.app.cli", "demo", "--store", str(store), "--run", "cut", "--model",
           "tiny", "--trace", str(TRACE), "--requests", "60", "--time-scale", "1", "--no-dashboard",
           "--device", "cpu"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "COLUMNS": "160"}, preexec_fn=_default_sigint)
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("[3/6]"):
            break
    text = "".join(lines)
    pgid = int(re.search(r"process group (\d+)", text).group(1))
    # Interrupt mid-load: the first 10 requests are sent at once, the rest over ~20 s of trace time.
    time.sleep(2.0)
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, text + rest
    assert "interrupted" in rest
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    run = tokentrace.open(store, run="cut")
    roles = {Role.from_label(i["role"]) for i in run.instances()}
    assert {Role.CLIENT, Role.GATEWAY} <= roles
    assert run.table(REQUESTS.name).num_rows > 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_dashboard_step_serves_the_store_until_ctrl_c(tmp_path):
    """Step 6 on the committed real run: the page answers on 127.0.0.1, Ctrl-C ends it cleanly."""
    port = _free_port()
    store = tmp_path / "real_run"  # a copy: serving a finished run saves its analysis facts next to it
    shutil.copytree(DATA / "real_run", store)
    code = ("from pathlib import Path; from rich.console import Console; from tokentrace.app.demo import serve_dashboard; "
            f"serve_dashboard(Path({str(store)!r}), port={port}, console=Console())")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_default_sigint)
    try:
        status = None
        deadline = time.monotonic() + 60
        while status is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                status = httpx.get(f"http://127.0.0.1:{port}/", timeout=2.0).status_code
            except httpx.TransportError:
                time.sleep(0.2)  # not listening yet
        assert status == 200
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert f"http://127.0.0.1:{port}/" in out and "dashboard stopped" in out


def _spec_run(store: Path, *, speculated: bool) -> None:
    """Two requests of 4 tokens on one engine; with ``speculated``, each one's tokens 1-2 come from one speculative
    step (2 proposals, 1 accepted: draft 1 ms, verify 3 ms), token 3 from a plain step either way."""
    import pyarrow as pa

    from tokentrace.schema import SPEC_STEPS
    from tokentrace.store import StoreWriter

    ms = 1_000_000
    rows: dict = {t.name: [] for t in (INSTANCES, REQUESTS, TOKENS, SPANS, SPEC_STEPS)}
    rows[INSTANCES.name].append({col.INSTANCE_ID: 1, col.ROLE: int(Role.COLOCATED), col.NAME: "engine-0",
                                 col.HOST: "h", col.PID: 1, col.MONO_ANCHOR_NS: 0, col.WALL_ANCHOR_NS: 0,
                                 col.CLOCK_OFFSET_NS: 0})
    for rid in (1, 2):
        t0 = rid * 100 * ms
        rows[REQUESTS.name].append({col.REQUEST_ID: rid, col.REQUEST_KEY: f"r{rid}", col.INSTANCE_ID: 1,
                                    col.ARRIVAL_NS: t0, col.FINISH_NS: t0 + 20 * ms, col.STATUS: 0})
        for i, t in enumerate((10, 14, 14, 18)):
            rows[TOKENS.name].append({col.REQUEST_ID: rid, col.TOKEN_INDEX: i, col.EMIT_NS: t0 + t * ms,
                                      col.INSTANCE_ID: 1})
        for stage, start, end, idx in ((Stage.PREFILL_COMPUTE, 0, 10, 0), (Stage.DECODE_COMPUTE, 14, 18, 3)):
            rows[SPANS.name].append({col.REQUEST_ID: rid, col.STAGE: int(stage), col.TOKEN_INDEX: idx,
                                     col.START_NS: t0 + start * ms, col.END_NS: t0 + end * ms, col.INSTANCE_ID: 1})
        if speculated:
            rows[SPEC_STEPS.name].append({
                col.INSTANCE_ID: 1, col.REQUEST_ID: rid, col.STEP: 1, col.DRAFT_SOURCE: 0, col.NUM_PROPOSED: 2,
                col.NUM_ACCEPTED: 1, col.FIRST_TOKEN_INDEX: 1, col.DRAFT_START_NS: t0 + 10 * ms,
                col.DRAFT_END_NS: t0 + 11 * ms, col.VERIFY_START_NS: t0 + 11 * ms, col.VERIFY_END_NS: t0 + 14 * ms,
                col.BATCH_SIZE: 1, col.NUM_SPEC_SEQS: 1})
    with StoreWriter(store, run_id="run") as w:
        for t in (INSTANCES, REQUESTS, TOKENS, SPANS, SPEC_STEPS):
            if rows[t.name]:
                w.write(t, pa.Table.from_pydict({c.name: [r.get(c.name) for r in rows[t.name]] for c in t.columns},
                                                schema=t.schema))
        w.register_instance(1, Role.COLOCATED, "engine-0")


def test_the_speculative_flag_reaches_the_servers_own_options(tmp_path, monkeypatch):
    """`tokentrace demo --speculative` -> the demo's options -> the server's argv, which the reference server's
    own argument parser reads as speculation on (a draft model) for the trained model."""
    import tokentrace.app.demo as demo_module
    from reference_server.launcher import parse_args
    from tokentrace.app.demo import demo_model

    seen: list[DemoOptions] = []
    monkeypatch.setattr(demo_module, "run_demo", lambda opts: seen.append(opts))
    register_commands()
    for argv, source, model in ((["--speculative"], "model", "trained"), ([], None, "trained"),
                                (["--speculative", "--model", "tiny"], "model", "tiny")):
        result = CliRunner().invoke(app, ["demo", "--store", str(tmp_path / "st"), "--trace", str(TRACE),
                                          "--no-dashboard", *argv])
        assert result.exit_code == 0, result.output
        opts = seen.pop()
        assert (opts.speculative, demo_model(opts)) == (source, model)
        spec = ServerSpec(store=Path("st"), run_id="r", tenants_file=Path("t.json"), model=demo_model(opts),
                          speculative=opts.speculative)
        argv_server = server_command(spec)
        args = parse_args(argv_server[argv_server.index("-m", argv_server.index("--")) + 2:])
        assert (args.speculative, args.model) == (source, model)


def test_the_terminal_report_shows_speculation_only_when_the_run_speculated(tmp_path):
    from tokentrace.app.demo.report import print_report
    from tokentrace.app.report import make_report

    for speculated in (True, False):
        store = tmp_path / f"st-{speculated}"
        _spec_run(store, speculated=speculated)
        out = io.StringIO()
        print_report(make_report(store), Console(file=out, width=160, force_terminal=False))
        text = out.getvalue()
        assert ("Speculative decoding" in text) is speculated
        if speculated:
            assert "2 speculative step(s) of 2 request(s)" in text and "50.0% were accepted" in text
