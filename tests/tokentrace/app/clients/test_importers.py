"""Client results of AIPerf, guidellm and vllm bench become a run's client lane (ingest-client).

The AIPerf case is a real AIPerf 0.13 run against the reference server and the store the
server wrote (tests/data/client_exports); guidellm and vllm bench files are built exactly as
their writers lay them out, around a server run written here with known times.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.compute as pc
import pytest
from typer.testing import CliRunner

import tokentrace
from analyzers.agreement import CLIENT_NS, SERVER_NS, agreement_summary, token_agreement
from tokentrace.app.cli import app, register_commands
from tokentrace.app.clients import import_client_file, read_client_file
from tokentrace.clock import Anchor
from tokentrace.recorder import BufferedRecorder
from tokentrace.schema import REQUESTS, TOKENS, RequestStatus, Role, col, request_id_of
from tokentrace.store import StoreError, StoreWriter

DATA = Path(__file__).resolve().parents[3] / "data" / "client_exports" / "aiperf-0.13-reference-server"
RUN = "aiperf-coloc"
runner = CliRunner()
register_commands()


@pytest.fixture
def aiperf_store(tmp_path: Path) -> Path:
    store = tmp_path / "store"
    shutil.copytree(DATA / "tokentrace-store", store)
    return store


def _tables(store: Path, run: str) -> dict:
    r = tokentrace.open(store, run=run)
    return {n: r.table(n) for n in ("requests", "tokens", "instances", "spans")}


def test_real_aiperf_run_fills_the_client_lane_matched_by_request_id(aiperf_store: Path):
    summary = import_client_file(DATA / "profile_export.jsonl", "aiperf", store=aiperf_store, run=RUN)
    assert (summary.tool, summary.version, summary.num_records) == ("aiperf", "0.13.0", 40)
    assert (summary.num_by_id, summary.num_by_time, summary.num_unmatched) == (40, 0, 0)
    records = [json.loads(line) for line in (DATA / "profile_export.jsonl").read_text().splitlines()]
    assert summary.num_chunks == sum(1 + len(r["metrics"].get("inter_chunk_latency", {}).get("value", []))
                                     for r in records)
    t = _tables(aiperf_store, RUN)
    inst = t["instances"].to_pylist()
    client = [i for i in inst if i[col.ROLE] == Role.CLIENT]
    assert [c[col.NAME] for c in client] == ["aiperf-client"]
    cid = client[0][col.INSTANCE_ID]
    req = t["requests"].filter(pc.equal(t["requests"].column(col.INSTANCE_ID), cid)).to_pylist()
    assert sorted(r[col.REQUEST_KEY] for r in req) == sorted(r["metadata"]["x_request_id"] for r in records)
    by_key = {r[col.REQUEST_KEY]: r for r in req}
    for rec in records:
        row = by_key[rec["metadata"]["x_request_id"]]
        ttft_ms = rec["metrics"]["time_to_first_token"]["value"]
        # the client's own TTFT survives the move onto the server's clock (to the ns rounding)
        assert abs((row[col.FIRST_TOKEN_NS] - row[col.ARRIVAL_NS]) - ttft_ms * 1e6) <= 1
        assert row[col.FIRST_CONTENT_NS] == row[col.FIRST_TOKEN_NS]
        assert row[col.NUM_OUTPUT_TOKENS] == rec["metrics"]["usage_completion_tokens"]["value"]
        assert row[col.NUM_CACHED_TOKENS] == rec["metrics"]["usage_prompt_cache_read_tokens"]["value"]
        assert row[col.STATUS] == RequestStatus.OK
        # AIPerf's conversation and turn become the session
        assert (row[col.SESSION], row[col.SESSION_TURN]) == (rec["metadata"]["conversation_id"],
                                                             rec["metadata"]["turn_index"])
    # the client's send is before the server saw the request, by connection set-up and accept
    server = {r[col.REQUEST_KEY]: r[col.ARRIVAL_NS] for r in t["requests"].to_pylist()
              if r[col.INSTANCE_ID] != cid and r[col.ARRIVAL_NS] is not None}
    lags_ms = [(server[k] - r[col.ARRIVAL_NS]) / 1e6 for k, r in by_key.items()]
    assert all(0 < lag < 100 for lag in lags_ms)


def test_real_aiperf_run_agreement_compares_content_chunks(aiperf_store: Path):
    import_client_file(DATA / "profile_export.jsonl", "aiperf", store=aiperf_store, run=RUN)
    t = _tables(aiperf_store, RUN)
    summary = agreement_summary(t["requests"], t["tokens"], t["instances"], t["spans"]).set_index("metric")
    # every AIPerf chunk found its server chunk: 40 TTFTs and every inter-chunk gap
    assert summary.loc["ttft", "count"] == 40
    assert summary.loc["itl", "count"] == 504 - 40
    # the server's TTFT is shorter than the client's (connect, accept), never by more than the lag
    ttft = token_agreement(t["requests"], t["tokens"], t["instances"], t["spans"])
    first = ttft[ttft[col.TOKEN_INDEX] == 0]
    assert ((first[SERVER_NS] - first[CLIENT_NS]) < 1_000_000).all()
    assert ((first[SERVER_NS] - first[CLIENT_NS]) > -100_000_000).all()
    # delivery jitter only: centred on zero, bounded by a few ms (a misaligned chunk is a 40 ms step)
    assert abs(summary.loc["itl", "mean_ms"]) < 0.5
    assert summary.loc["itl", "max_abs_ms"] < 20
    # the server sent text-less chunks AIPerf does not count: they add into the next content chunk
    assert len(ttft) == 504


def test_report_shows_the_agreement_of_an_imported_aiperf_run(aiperf_store: Path):
    out = runner.invoke(app, ["ingest-client", str(DATA / "profile_export.jsonl"), "--format", "aiperf",
                              "--store", str(aiperf_store), "--run", RUN])
    assert out.exit_code == 0, out.output
    assert "matched 40 by request id" in out.output
    again = runner.invoke(app, ["ingest-client", str(DATA / "profile_export.jsonl"), "--format", "aiperf",
                                "--store", str(aiperf_store), "--run", RUN])
    assert again.exit_code == 2 and "already has a aiperf-client lane" in again.output
    report = runner.invoke(app, ["report", str(aiperf_store), "--run", RUN])
    assert "no client-side rows" not in report.output
    assert "| ttft | 40 |" in report.output and "| itl | 464 |" in report.output


def test_aiperf_statuses_and_units(tmp_path: Path):
    base = {"metadata": {"x_request_id": "a", "request_start_ns": 1_000_000_000, "request_end_ns": 1_900_000_000},
            "metrics": {"time_to_first_token": {"value": 0.25, "unit": "sec"},
                        "inter_chunk_latency": {"value": [10_000, 20_000], "unit": "us"}}}
    failed = {"metadata": {"x_request_id": "b", "request_start_ns": 2_000_000_000, "request_end_ns": 2_100_000_000},
              "metrics": {}, "error": {"code": 429, "type": "Too Many Requests", "message": "slow down"}}
    cancelled = {"metadata": {"x_request_id": "c", "request_start_ns": 3_000_000_000,
                              "request_end_ns": 3_100_000_000, "was_cancelled": True}, "metrics": {}}
    path = tmp_path / "profile_export.jsonl"
    path.write_text("\n".join(json.dumps(o) for o in (base, failed, cancelled)) + "\n")
    export = read_client_file(path, "aiperf")
    ok, rejected, aborted = export.records
    assert ok.chunks == ((0, 1_250_000_000), (1, 1_260_000_000), (2, 1_280_000_000))
    assert (rejected.status, rejected.error, rejected.chunks) == (RequestStatus.REJECTED, "Too Many Requests", ())
    assert aborted.status == RequestStatus.ABORTED
    assert ok.num_output_tokens == -1  # not in the file: not reported, never 0
    path.write_text(json.dumps({"metadata": {}, "metrics": {}}) + "\n")
    with pytest.raises(ValueError, match="request_start_ns"):
        read_client_file(path, "aiperf")


# -- a server run with known times, for the tools that send or save no request id

ANCHOR = Anchor(mono_ns=10_000_000_000, wall_ns=1_800_000_000_000_000_000)
ARRIVALS = (10_100_000_000, 10_150_000_000, 10_400_000_000)  # server monotonic clock, ns
NUM_TOKENS = 4
TTFT = 80_000_000
ITL = 20_000_000


def _server_run(store: Path, run: str, tenant: str = "") -> None:
    writer = StoreWriter(store, run_id=run)
    rec = BufferedRecorder(writer, instance_id=writer.instance_id)
    rec.instance(role=Role.GATEWAY, name="gateway", anchor=ANCHOR)
    for n, arrival in enumerate(ARRIVALS):
        rid = rec.request_begin(f"srv-{n}", tenant=tenant, arrival_ns=arrival)
        sent = [arrival + TTFT + i * ITL for i in range(NUM_TOKENS)]
        for i, t in enumerate(sent):
            rec.token(rid, i, sent_ns=t)
        rec.request_end(rid, finish_ns=sent[-1], first_token_ns=sent[0], num_output_tokens=NUM_TOKENS)
    rec.close()


def _client_rows(store: Path, run: str, name: str) -> tuple[list[dict], list[dict]]:
    r = tokentrace.open(store, run=run)
    inst = [i for i in r.table("instances").to_pylist() if i[col.NAME] == name]
    assert len(inst) == 1 and inst[0][col.ROLE] == Role.CLIENT
    cid = inst[0][col.INSTANCE_ID]
    req = [x for x in r.table(REQUESTS.name).to_pylist() if x[col.INSTANCE_ID] == cid]
    tok = [x for x in r.table(TOKENS.name).to_pylist() if x[col.INSTANCE_ID] == cid]
    return req, tok


LAG = 3_000_000  # the client sends 3 ms before the server sees the request
RECV = 200_000  # and reads each chunk 0.2 ms after the server wrote it


def test_vllm_bench_detailed_result_matches_by_send_time(tmp_path: Path):
    _server_run(tmp_path / "s", "r", tenant="acme")  # a tenant's requests: the client rows take its ids
    starts = [(a - LAG) / 1e9 for a in ARRIVALS]  # perf_counter seconds: CLOCK_MONOTONIC
    result = {"date": "20261201-120000", "backend": "openai-chat", "completed": 3, "failed": 0,
              "input_lens": [100, 120, 90], "output_lens": [NUM_TOKENS] * 3,
              "ttfts": [(TTFT + LAG + RECV) / 1e9] * 3, "itls": [[ITL / 1e9] * (NUM_TOKENS - 1)] * 3,
              "start_times": starts, "generated_texts": ["abcd"] * 3, "errors": ["", "", ""]}
    path = tmp_path / "vllm.json"
    path.write_text(json.dumps(result))
    summary = import_client_file(path, "vllm-bench", store=tmp_path / "s", run="r")
    assert (summary.num_by_id, summary.num_by_time, summary.num_unmatched) == (0, 3, 0)
    req, tok = _client_rows(tmp_path / "s", "r", "vllm-bench-client")
    assert sorted(r[col.REQUEST_KEY] for r in req) == ["srv-0", "srv-1", "srv-2"]
    for r in req:
        n = int(r[col.REQUEST_KEY][-1])
        assert abs(r[col.ARRIVAL_NS] - (ARRIVALS[n] - LAG)) <= 1000  # seconds as floats: sub-us rounding
    assert len(tok) == 3 * NUM_TOKENS
    t = _tables(tmp_path / "s", "r")
    df = token_agreement(t["requests"], t["tokens"], t["instances"])
    assert len(df) == 3 * NUM_TOKENS
    first, rest = df[df[col.TOKEN_INDEX] == 0], df[df[col.TOKEN_INDEX] > 0]
    assert ((first["diff_ns"] + LAG + RECV).abs() <= 2000).all()
    assert (rest["diff_ns"].abs() <= 2000).all()


def test_guidellm_report_matches_by_send_time_and_compares_ttft_only(tmp_path: Path):
    _server_run(tmp_path / "s", "r")

    def unix_s(mono: int) -> float:
        return ANCHOR.to_wall_ns(mono) / 1e9

    def request(n: int, arrival: int) -> dict:
        first = arrival + TTFT + RECV
        guide_id = col.REQUEST_ID  # guidellm's own field happens to share our column's name
        return {"type_": "generative_request_stats", guide_id: f"guide-{n}", "request_type": "chat_completions",
                "info": {guide_id: f"guide-{n}", "status": "completed", "error": None,
                         "timings": {"request_start": unix_s(arrival - LAG), "first_token_iteration": unix_s(first),
                                     "last_token_iteration": unix_s(first + (NUM_TOKENS - 1) * ITL),
                                     "token_iterations": NUM_TOKENS, "request_end": unix_s(first + 3 * ITL)}},
                "input_metrics": {"total_tokens": 100}, "output_metrics": {"total_tokens": NUM_TOKENS},
                "prompt_tokens": 100, "output_tokens": NUM_TOKENS, "cached_tokens": None}

    reqs = [request(n, a) for n, a in enumerate(ARRIVALS)]
    report = {"metadata": {"guidellm_version": "0.8.1"},
              "benchmarks": [{"type_": "generative_benchmark",
                              "requests": {"successful": reqs[:2], "errored": [], "incomplete": reqs[2:]}}]}
    path = tmp_path / "benchmarks.json"
    path.write_text(json.dumps(report))
    summary = import_client_file(path, "guidellm", store=tmp_path / "s", run="r")
    assert (summary.version, summary.num_by_time, summary.num_unmatched) == ("0.8.1", 3, 0)
    req, tok = _client_rows(tmp_path / "s", "r", "guidellm-client")
    status = {r[col.REQUEST_KEY]: r[col.STATUS] for r in req}
    assert status == {"srv-0": RequestStatus.OK, "srv-1": RequestStatus.OK, "srv-2": RequestStatus.ABORTED}
    assert sorted((x[col.TOKEN_INDEX] for x in tok if x[col.REQUEST_ID] == request_id_of("srv-0"))) == [0, 3]
    t = _tables(tmp_path / "s", "r")
    summary_df = agreement_summary(t["requests"], t["tokens"], t["instances"]).set_index("metric")
    assert summary_df.loc["ttft", "count"] == 3
    assert summary_df.loc["itl", "count"] == 0  # only the first and last chunks are known: no gap is invented
    assert abs(summary_df.loc["ttft", "mean_ms"] + (LAG + RECV) / 1e6) < 0.01


def test_bad_input_is_one_sentence(tmp_path: Path):
    _server_run(tmp_path / "s", "r")
    path = tmp_path / "vllm.json"
    path.write_text(json.dumps({"completed": 3, "ttfts": [0.1]}))
    with pytest.raises(ValueError, match="--save-detailed"):
        import_client_file(path, "vllm-bench", store=tmp_path / "s", run="r")
    out = runner.invoke(app, ["ingest-client", str(path), "--format", "locust", "--store", str(tmp_path / "s"),
                              "--run", "r"])
    assert out.exit_code == 2 and "unknown client format 'locust'" in out.output
    with pytest.raises(StoreError):
        import_client_file(DATA / "profile_export.jsonl", "aiperf", store=tmp_path / "s", run="nope")
