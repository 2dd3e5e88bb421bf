"""Stores for the report tests: a real engine run, and hand-made baseline/candidate runs.

* ``engine_store``: the tiny reference engine, instrumented with ``tokentrace.instrument``,
  serving 8 requests (two tenants, two SLO classes) of 6 tokens: every table present.
* ``planted_stores``: (baseline, candidate) hand-made runs of 30 requests x 12 tokens that
  differ only in decode time: the candidate's ITL is twice the baseline's.
* ``aa_store``: three runs (``aa-1`` .. ``aa-3``) of the baseline's configuration with other jitter
  seeds: A/A runs whose spread is the run-to-run noise (``--noise``); ``candidate_runs`` likewise of the
  candidate's configuration.
* ``client_store``: a planted run also seen by a load generator (client role).
* ``bare_store``: requests and tokens only (no spans, steps or cache events).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

import tokentrace
from tokentrace.schema import INSTANCES, REQUESTS, SPANS, TOKENS, Role, Stage, col
from tokentrace.store import StoreWriter

torch.set_num_threads(1)
MS = 1_000_000  # ns
CLIENT_ID = 9  # instance id of the load generator in hand-made runs


@pytest.fixture(scope="session")
def engine_store(tmp_path_factory) -> Path:
    from reference_server.engine.config import EngineConfig, TenantConfig
    from reference_server.engine.engine import Engine
    from reference_server.model import SamplingParams

    store = tmp_path_factory.mktemp("engine-store")
    config = EngineConfig(model="tiny", block_size=4, num_device_blocks=128,
                          tenants=(TenantConfig("acme"), TenantConfig("globex")), default_tenant="acme")
    engine = Engine(config)
    handle = tokentrace.instrument(engine, store=store, run="real")
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"req-{i}", f"a shared system prompt, then question number {i}", sampling,
                           tenant=("acme", "globex")[i % 2], slo_class=("interactive", "batch")[i % 2])
    while engine.has_unfinished():
        engine.step()
    handle.close()
    engine.close()
    return store


def table(t, rows: list[dict]) -> pa.Table:
    """Rows (dicts keyed by ``col`` names) as an Arrow table of store table ``t``."""
    return pa.Table.from_pydict({c.name: [r.get(c.name) for r in rows] for c in t.columns}, schema=t.schema)


def _instance_rows() -> list[dict]:
    return [{col.INSTANCE_ID: 1, col.ROLE: int(Role.COLOCATED), col.NAME: "engine-0", col.HOST: "h",
             col.PID: 1, col.MONO_ANCHOR_NS: 0, col.WALL_ANCHOR_NS: 0, col.CLOCK_OFFSET_NS: 0}]


def _span(rid: int, stage: Stage, start: int, end: int, idx: int) -> dict:
    return {col.REQUEST_ID: rid, col.STAGE: int(stage), col.TOKEN_INDEX: idx, col.START_NS: start,
            col.END_NS: end, col.INSTANCE_ID: 1}


def write_planted_run(store: Path, run_id: str, *, decode_ms: float, seed: int = 0,
                      with_spans: bool = True, with_client: bool = False) -> None:
    """30 requests, 1 s apart: queue 2 ms + prefill 8 ms, then 11 tokens of 0.5 ms queue + decode_ms
    (+-10% jitter) each. Every token's stages tile its interval exactly. ``with_client``: a load
    generator (instance 9) also saw each request, sending it 1 ms before the server's arrival and
    receiving each token 0.5 ms after it was emitted."""
    rng = np.random.default_rng(seed)
    requests, tokens, spans = [], [], []
    for r in range(30):
        rid, t = 100 + r, r * 1000 * MS
        requests.append({col.REQUEST_ID: rid, col.REQUEST_KEY: f"req-{r}", col.INSTANCE_ID: 1,
                         col.TENANT: ("acme", "globex")[r % 2], col.SLO_CLASS: "interactive", col.ARRIVAL_NS: t,
                         col.NUM_PROMPT_TOKENS: 64, col.NUM_CACHED_TOKENS: 0, col.NUM_OUTPUT_TOKENS: 12,
                         col.STATUS: 0})
        spans += [_span(rid, Stage.SCHEDULE_QUEUE, t, t + 2 * MS, 0),
                  _span(rid, Stage.PREFILL_COMPUTE, t + 2 * MS, t + 10 * MS, 0)]
        t += 10 * MS
        tokens.append({col.REQUEST_ID: rid, col.TOKEN_INDEX: 0, col.EMIT_NS: t, col.INSTANCE_ID: 1})
        for i in range(1, 12):
            compute = int(decode_ms * MS * rng.uniform(0.9, 1.1))
            spans += [_span(rid, Stage.DECODE_QUEUE, t, t + MS // 2, i),
                      _span(rid, Stage.DECODE_COMPUTE, t + MS // 2, t + MS // 2 + compute, i)]
            t += MS // 2 + compute
            tokens.append({col.REQUEST_ID: rid, col.TOKEN_INDEX: i, col.EMIT_NS: t, col.INSTANCE_ID: 1})
        requests[-1][col.FINISH_NS] = t
    instances = _instance_rows()
    if with_client:
        instances.append(dict(instances[0], **{col.INSTANCE_ID: CLIENT_ID, col.ROLE: int(Role.CLIENT)}))
        requests += [dict(r, **{col.INSTANCE_ID: CLIENT_ID, col.ARRIVAL_NS: r[col.ARRIVAL_NS] - MS})
                     for r in requests]
        tokens += [{col.REQUEST_ID: t[col.REQUEST_ID], col.TOKEN_INDEX: t[col.TOKEN_INDEX], col.INSTANCE_ID: CLIENT_ID,
                    col.RECV_NS: t[col.EMIT_NS] + MS // 2} for t in tokens]
    with StoreWriter(store, run_id=run_id) as w:
        w.write(INSTANCES, table(INSTANCES, instances))
        w.write(REQUESTS, table(REQUESTS, requests))
        w.write(TOKENS, table(TOKENS, tokens))
        if with_spans:
            w.write(SPANS, table(SPANS, spans))
        w.register_instance(1, Role.COLOCATED, "engine-0")


@pytest.fixture(scope="session")
def planted_stores(tmp_path_factory) -> tuple[Path, Path]:
    base, cand = tmp_path_factory.mktemp("baseline"), tmp_path_factory.mktemp("candidate")
    write_planted_run(base, "base", decode_ms=5.0, seed=1)
    write_planted_run(cand, "cand", decode_ms=10.0, seed=2)
    return base, cand


@pytest.fixture(scope="session")
def aa_store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("aa")
    for i in (1, 2, 3):
        write_planted_run(store, f"aa-{i}", decode_ms=5.0, seed=10 + i)
    return store


@pytest.fixture(scope="session")
def candidate_runs(tmp_path_factory) -> Path:
    """Three runs (``c-1`` .. ``c-3``) of the candidate's configuration (decode twice as long)."""
    store = tmp_path_factory.mktemp("cands")
    for i in (1, 2, 3):
        write_planted_run(store, f"c-{i}", decode_ms=10.0, seed=20 + i)
    return store


@pytest.fixture(scope="session")
def client_store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("client")
    write_planted_run(store, "client", decode_ms=5.0, with_client=True)
    return store


@pytest.fixture(scope="session")
def bare_store(tmp_path_factory) -> Path:
    store = tmp_path_factory.mktemp("bare")
    write_planted_run(store, "bare", decode_ms=5.0, with_spans=False)
    return store
