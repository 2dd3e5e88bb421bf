"""What a run says about its workload and its engines: the simulator's inputs, read from the store.

All times are ns on the run's reference clock (the views of :class:`~analyzers.source.Source`).

* :class:`TracedRequest`: one request as the client sent it: when it reached the server
  (``arrival``, the outermost process), when it reached its engine (``engine_arrival``),
  prompt, cached and output token counts, its SLO class, and how many of its first tokens
  carried no visible text (a byte that completes no character): TTFT counts to the first
  visible content, and the tokens before it go out with it.
* :class:`EngineSpec`: one engine instance's serving configuration, from ``engine_configs``
  when the run has it (schema 4); otherwise inferred from its steps (``inferred`` is True):
  the largest batch and token count seen as the limits, the device tier size the steps
  report, FCFS. An inferred limit is a lower bound of the real one; the fit then reproduces
  the run but a prediction that raises a limit may be optimistic.
* :class:`StepRows`: every engine step (instance, duration, prefill and decode tokens,
  sequences, the summed context of the step's sequences, the gap before the next step).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from analyzers.source import Source
from analyzers.timing import TOKEN_END, request_table, token_times
from tokentrace.schema import ENGINE_CONFIGS, RequestStatus, Role, Stage, col

__all__ = ["EngineSpec", "TracedRequest", "StepRows", "RunTrace", "read_trace"]

_ENGINE_ROLES = (int(Role.COLOCATED), int(Role.PREFILL), int(Role.DECODE))


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine instance's serving configuration (the knobs the simulator honours)."""

    instance_id: int
    role: Role
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    num_device_blocks: int
    scheduling_policy: str = "fcfs"
    chunked_prefill: bool = True
    inferred: bool = False  # True: read off the steps, not recorded


@dataclass(frozen=True, slots=True)
class TracedRequest:
    """One request of the run (ns, reference clock)."""

    request_id: int
    arrival_ns: int
    engine_arrival_ns: int
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    slo_class: str
    tenant: str
    ok: bool
    first_visible_index: int = 0  # output tokens before the first one that carried visible text (held back)


@dataclass(frozen=True, slots=True)
class StepRows:
    """Engine steps as columns (one entry per step)."""

    instance_id: np.ndarray  # int64
    role: np.ndarray  # int64 (Role)
    duration_ns: np.ndarray  # float64, end - start
    gap_ns: np.ndarray  # float64, start of the next step of the instance - this end; NaN for the last
    num_prefill_tokens: np.ndarray
    num_decode_tokens: np.ndarray
    num_seqs: np.ndarray
    decode_context: np.ndarray  # summed context (prompt + tokens so far) of the step's decode tokens
    busy_after: np.ndarray  # bool: work was left after the step (waiting, or running requests that did not finish)
    start_ns: np.ndarray | None = None  # float64, when the step started (reference clock); None: not known


@dataclass(frozen=True, slots=True)
class RunTrace:
    """Everything the fit and the replay need from one run."""

    requests: tuple[TracedRequest, ...]
    engines: tuple[EngineSpec, ...]
    steps: StepRows
    first_delivery_lag_ns: np.ndarray  # per request: first visible token delivered - its engine emit
    delivery_lag_ns: np.ndarray  # per token i >= 1: delivered - emitted
    handoff: pd.DataFrame  # disaggregated: prompt tokens (col.NUM_PROMPT_TOKENS), handoff_ns (prefill emit -> decode engine arrival)


def read_trace(src: Source) -> RunTrace:
    """The run's requests, engines and steps; ``ValueError`` (one sentence) when the run has no engine steps or
    no served request (nothing to fit a model of an engine to)."""
    steps = _steps(src)
    if steps.duration_ns.size == 0:
        raise ValueError("the run has no engine steps (steps table): nothing to fit an engine model to")
    engines = _engines(src)
    requests = _requests(src, {e.instance_id for e in engines})
    if not any(r.ok for r in requests):
        raise ValueError("the run has no served request with an engine arrival: nothing to replay")
    first_lag, lag = _delivery_lags(src)
    return RunTrace(tuple(requests), tuple(engines), steps, first_lag, lag, _handoffs(src))


def _engine_instances(src: Source) -> pd.DataFrame:
    c = col
    return src.df(f"""
        SELECT s.{c.INSTANCE_ID} AS iid, COALESCE(MAX(i.{c.ROLE}), {int(Role.COLOCATED)}) AS role,
               MAX(s.{c.NUM_SEQS}) AS max_seqs, MAX(s.{c.NUM_PREFILL_TOKENS} + s.{c.NUM_DECODE_TOKENS}) AS max_tokens,
               MAX(s.{c.NUM_BLOCKS_TOTAL_DEVICE}) AS blocks
        FROM steps s LEFT JOIN instances i ON s.{c.INSTANCE_ID} = i.{c.INSTANCE_ID}
        GROUP BY s.{c.INSTANCE_ID} ORDER BY s.{c.INSTANCE_ID}""")


def _engines(src: Source) -> list[EngineSpec]:
    c = col
    seen = _engine_instances(src)
    cfg = src.df(f"""
        SELECT {c.INSTANCE_ID} AS iid, MAX({c.ROLE}) AS role, MAX({c.MAX_NUM_SEQS}) AS seqs,
               MAX({c.MAX_NUM_BATCHED_TOKENS}) AS budget, MAX({c.KV_BLOCK_SIZE}) AS bs,
               MAX({c.NUM_BLOCKS_TOTAL_DEVICE}) AS blocks,
               MAX({c.SCHEDULING_POLICY}) AS policy, MAX({c.CHUNKED_PREFILL}) AS chunked
        FROM {ENGINE_CONFIGS.name} GROUP BY {c.INSTANCE_ID}""")  # one configuration per engine instance
    recorded = {int(r.iid): r for r in cfg.itertuples()}
    out = []
    for r in seen.itertuples():
        iid = int(r.iid)
        role = Role(int(r.role)) if int(r.role) in _ENGINE_ROLES else Role.COLOCATED
        rec = recorded.get(iid)
        if rec is not None and not pd.isna(rec.seqs):
            out.append(EngineSpec(
                iid, Role(int(rec.role)), int(rec.seqs), int(rec.budget), int(rec.bs or 16),
                int(rec.blocks) if not pd.isna(rec.blocks) else int(r.blocks or 1 << 30),
                str(rec.policy or "fcfs"), bool(rec.chunked) if not pd.isna(rec.chunked) else True))
        else:
            blocks = int(r.blocks) if not pd.isna(r.blocks) and r.blocks else 1 << 30
            out.append(EngineSpec(iid, role, max(1, int(r.max_seqs)), max(1, int(r.max_tokens)), 16, blocks,
                                  inferred=True))
    return out


def _steps(src: Source) -> StepRows:
    c = col
    df = src.df(f"""
        WITH prompt AS (SELECT {c.REQUEST_ID}, MAX({c.NUM_PROMPT_TOKENS}) AS n FROM srv_requests
                        GROUP BY {c.REQUEST_ID}),
        emitted AS (SELECT DISTINCT {c.INSTANCE_ID}, {c.STEP}, {c.REQUEST_ID}, {c.TOKEN_INDEX} FROM srv_tokens
                    WHERE {c.EMIT_NS} IS NOT NULL AND {c.STEP} IS NOT NULL AND {c.TOKEN_INDEX} > 0),
        ctx AS (SELECT e.{c.INSTANCE_ID}, e.{c.STEP}, SUM(COALESCE(p.n, 0) + e.{c.TOKEN_INDEX}) AS context
                FROM emitted e LEFT JOIN prompt p USING ({c.REQUEST_ID}) GROUP BY e.{c.INSTANCE_ID}, e.{c.STEP}),
        last AS (SELECT {c.INSTANCE_ID}, {c.REQUEST_ID}, arg_max({c.STEP}, {c.TOKEN_INDEX}) AS step_done
                 FROM srv_tokens WHERE {c.EMIT_NS} IS NOT NULL AND {c.STEP} IS NOT NULL
                 GROUP BY {c.INSTANCE_ID}, {c.REQUEST_ID}),
        done AS (SELECT {c.INSTANCE_ID}, step_done AS {c.STEP}, COUNT(*) AS finished FROM last
                 GROUP BY {c.INSTANCE_ID}, step_done)
        SELECT s.{c.INSTANCE_ID} AS iid, COALESCE(i.{c.ROLE}, {int(Role.COLOCATED)}) AS role,
               s.{c.START_NS} AS start, s.{c.END_NS} - s.{c.START_NS} AS dur,
               LEAD(s.{c.START_NS}) OVER (PARTITION BY s.{c.INSTANCE_ID} ORDER BY s.{c.STEP}) - s.{c.END_NS} AS gap,
               s.{c.NUM_PREFILL_TOKENS} AS p, s.{c.NUM_DECODE_TOKENS} AS d, s.{c.NUM_SEQS} AS n,
               COALESCE(ctx.context, 0) AS context,
               s.{c.NUM_WAITING} > 0 OR s.{c.NUM_RUNNING} - COALESCE(done.finished, 0) > 0 AS busy
        FROM steps s LEFT JOIN instances i ON s.{c.INSTANCE_ID} = i.{c.INSTANCE_ID}
        LEFT JOIN ctx ON s.{c.INSTANCE_ID} = ctx.{c.INSTANCE_ID} AND s.{c.STEP} = ctx.{c.STEP}
        LEFT JOIN done ON s.{c.INSTANCE_ID} = done.{c.INSTANCE_ID} AND s.{c.STEP} = done.{c.STEP}
        WHERE s.{c.END_NS} >= s.{c.START_NS}
        ORDER BY s.{c.INSTANCE_ID}, s.{c.STEP}""")
    return StepRows(df["iid"].to_numpy("int64"), df["role"].to_numpy("int64"), df["dur"].to_numpy(float),
                    df["gap"].to_numpy(float), df["p"].to_numpy(float), df["d"].to_numpy(float),
                    df["n"].to_numpy(float), df["context"].to_numpy(float), df["busy"].to_numpy(bool),
                    df["start"].to_numpy(float))


def _requests(src: Source, engine_ids: set[int]) -> list[TracedRequest]:
    c = col
    ids = ", ".join(str(i) for i in sorted(engine_ids)) or "NULL"
    df = src.df(f"""
        WITH e AS (
            SELECT {c.REQUEST_ID}, MIN({c.ARRIVAL_NS}) AS engine_arrival
            FROM srv_requests WHERE {c.INSTANCE_ID} IN ({ids}) GROUP BY {c.REQUEST_ID}
        ), emits AS (
            SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, MIN({c.EMIT_NS}) AS emit FROM srv_tokens
            WHERE {c.EMIT_NS} IS NOT NULL GROUP BY {c.REQUEST_ID}, {c.TOKEN_INDEX}
        ), visible AS (
            SELECT m.{c.REQUEST_ID}, GREATEST(COUNT(*) - 1, 0) AS k
            FROM emits m JOIN {request_table(src)} f USING ({c.REQUEST_ID})
            WHERE m.emit <= f.{c.FIRST_TOKEN_NS} GROUP BY m.{c.REQUEST_ID}
        )
        SELECT f.{c.REQUEST_ID} AS rid, f.{c.ARRIVAL_NS} AS arrival, COALESCE(e.engine_arrival, f.{c.ARRIVAL_NS}) AS ea,
               COALESCE(f.{c.NUM_PROMPT_TOKENS}, 1) AS prompt, COALESCE(f.{c.NUM_CACHED_TOKENS}, 0) AS cached,
               f.{c.NUM_OUTPUT_TOKENS} AS output, f.{c.SLO_CLASS} AS slo, f.{c.TENANT} AS tenant,
               COALESCE(f.{c.STATUS}, 0) = {int(RequestStatus.OK)} AND f.{c.FIRST_TOKEN_NS} IS NOT NULL AS ok,
               COALESCE(v.k, 0) AS k
        FROM {request_table(src)} f LEFT JOIN e USING ({c.REQUEST_ID}) LEFT JOIN visible v USING ({c.REQUEST_ID})
        WHERE f.{c.ARRIVAL_NS} IS NOT NULL ORDER BY f.{c.ARRIVAL_NS}""")
    return [TracedRequest(int(r.rid), int(r.arrival), int(max(r.ea, r.arrival)), max(1, int(r.prompt)),
                          max(0, int(r.cached)), max(1, int(r.output)), str(r.slo or ""), str(r.tenant or ""),
                          bool(r.ok), int(r.k))
            for r in df.itertuples()]


def _delivery_lags(src: Source) -> tuple[np.ndarray, np.ndarray]:
    """How long after its engine emitted it a token reached the client stream (detokenize, relay, send): for
    the first visible content, from the emit of the last token it carries; for later tokens, their own."""
    c = col
    tt = token_times(src)
    df = src.df(f"""
        WITH e AS (SELECT {c.REQUEST_ID}, {c.TOKEN_INDEX}, MIN({c.EMIT_NS}) AS emit FROM srv_tokens
                   WHERE {c.EMIT_NS} IS NOT NULL GROUP BY {c.REQUEST_ID}, {c.TOKEN_INDEX}),
        f AS (SELECT {c.REQUEST_ID}, {c.FIRST_TOKEN_NS} AS first_ns FROM {request_table(src)}),
        first_lag AS (SELECT f.{c.REQUEST_ID}, f.first_ns - MAX(e.emit) AS lag FROM f JOIN e USING ({c.REQUEST_ID})
                      WHERE e.emit <= f.first_ns GROUP BY f.{c.REQUEST_ID}, f.first_ns)
        SELECT 0 AS later, lag FROM first_lag
        UNION ALL
        SELECT 1, t.{TOKEN_END} - e.emit FROM {tt} t JOIN e USING ({c.REQUEST_ID}, {c.TOKEN_INDEX})
        JOIN f USING ({c.REQUEST_ID}) WHERE t.{TOKEN_END} > f.first_ns""")
    first = df[df["later"] == 0]["lag"].to_numpy(float)
    rest = df[df["later"] == 1]["lag"].to_numpy(float)
    return first[np.isfinite(first)], rest[np.isfinite(rest)]


def _handoffs(src: Source) -> pd.DataFrame:
    """Per disaggregated request: its prompt length and the time from its prefill engine's first token to its
    arrival at the decode engine (the KV transfer and the hand-over around it)."""
    c = col
    return src.df(f"""
        WITH roles AS (SELECT {c.INSTANCE_ID}, {c.ROLE} FROM instances),
        p AS (SELECT t.{c.REQUEST_ID}, MIN(t.{c.EMIT_NS}) AS emit FROM srv_tokens t JOIN roles USING ({c.INSTANCE_ID})
              WHERE {c.ROLE} = {int(Role.PREFILL)} AND t.{c.TOKEN_INDEX} = 0 GROUP BY t.{c.REQUEST_ID}),
        d AS (SELECT r.{c.REQUEST_ID}, MIN(r.{c.ARRIVAL_NS}) AS arrival, MAX(r.{c.NUM_PROMPT_TOKENS}) AS prompt
              FROM srv_requests r JOIN roles USING ({c.INSTANCE_ID})
              WHERE {c.ROLE} = {int(Role.DECODE)} GROUP BY r.{c.REQUEST_ID}),
        x AS (SELECT {c.REQUEST_ID}, SUM({c.END_NS} - {c.START_NS}) AS transfer FROM spans
              WHERE {c.STAGE} = {int(Stage.TRANSFER_KV)} GROUP BY {c.REQUEST_ID})
        SELECT COALESCE(d.prompt, 0) AS {c.NUM_PROMPT_TOKENS},
               GREATEST(COALESCE(x.transfer, 0), d.arrival - p.emit) AS handoff_ns
        FROM p JOIN d USING ({c.REQUEST_ID}) LEFT JOIN x USING ({c.REQUEST_ID})""")
