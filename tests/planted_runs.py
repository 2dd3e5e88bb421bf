"""Planted-fault runs of the reference server, with the truth of which requests the fault hit.

Each run is the real stack (``tokentrace run -- python -m reference_server ...``, tiny model,
CPU, loopback) driven by ``tokentrace bench``'s runner for a few seconds, with one known cause
planted through the server's own knobs (step budget, KV blocks, ``--delay``, tenants, load).
The load generator records its own view (role ``client``) into the same run, so a store holds
the server's and the client's rows.

The truth (:attr:`PlantedRun.hit`: the request keys the fault hit; :attr:`PlantedRun.unsure`: those it touched
too little to call, left out of the scores) is decided from the client's outcomes and the raw Parquet files of the
store, never from the analyzers:

==================  =============================  =========================================================
kind                planted                        hit
==================  =============================  =========================================================
head_of_line        3 prompts of 480 tokens among  short requests in flight (sent, first token not yet received)
                    100 short ones (5 tokens, one  beside a long one's prefill (from its send to its last
                    every 60 ms), a 32-token step  prefill chunk's end: client clock, raw spans) for at least
                    budget (chunked prefill), a    ``HOL_TTFT_MS``, the TTFT target it is judged on: they
                    prefill cost of 1 ms per       queued behind its 15 chunks, and the long prefill alone
                    prompt token (slept, so the    makes them miss (``unsure``: in flight beside it for less
                    long prefill holds the budget  than that; neither hit nor spared, left out of recall and
                    0.5 s on an idle or busy CPU)  precision)
prefix_miss         4 shared 440-token prefixes in requests whose prefix was sent before them but which were
                    turn, 160 device blocks (one   served fewer cached tokens than that prefix's full blocks
                    prompt's worth), a 32-token    (the server's usage, as the client received it); recomputing
                    step budget                    the prefix (14 steps) costs well over a KV handoff
preemption          110 device blocks, 10          requests with a ``schedule.preempted`` span in the raw
                    sequences of 24 + 64 tokens    spans table that ended after the server wrote their first
                    sent at once (22 blocks each   chunk and held that token gap past ``PREEMPTED_GAP_MS``
                    when done), decode steps of    (the raw tokens' ``sent_ns``): a preempted request waits
                    3 ms or more                   for another to finish (tens to hundreds of ms)
kv_transfer         ``--delay kv_transfer=40ms``   every request (disaggregated only)
noisy_neighbour     tenant ``noisy`` sends 24      the quiet tenants' requests sent between the burst's first
                    requests at once, two quiet    send and the drain of the backlog it built (its last
                    tenants send steadily          request's finish or, when later, the first engine step
                                                   after it with no request waiting: client clock; raw steps)
                                                   while one of the burst's requests was still in flight
                                                   (``unsure``: sent after the burst's last finish, before
                                                   the drain; only the backlog of others it had held back
                                                   was left, which only an attribution can charge to it)
slow_stage          ``--delay stream_send=30ms``   every request (stage ``stream.send``)
overload            15 req/s against one worker    requests sent while an earlier request was still running
                    of one sequence (>= 200 ms     (client clock): with one sequence at a time, they queued
                    each: 3x its capacity)
none                light load, nothing planted    no request
==================  =============================  =========================================================

:func:`build_run` builds one run; the ``planted_run`` fixture (tests/conftest.py) builds each
(kind, mode) once per test session, when a test first asks for it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tokentrace.app.bench.client import RequestOptions
from tokentrace.app.bench.plan import Plan
from tokentrace.app.bench.requests import Outcome, PlannedRequest, TextRequest
from tokentrace.app.bench.runner import RunLimits, run_bench
from tokentrace.app.bench.synthetic import random_text
from tokentrace.schema import INSTANCES, REQUESTS, SPANS, STEPS, TOKENS, Role, Stage, col

REPO = Path(__file__).resolve().parents[1]
MODES = ("colocated", "disagg")
KINDS = ("head_of_line", "prefix_miss", "preemption", "kv_transfer", "noisy_neighbour", "slow_stage", "overload",
         "none")
BLOCK_SIZE = 4
QUIET_TENANTS = ("quiet-a", "quiet-b")
NOISY_TENANT = "noisy"
PREEMPTED_GAP_MS = 40.0  # preemption: the ITL target it is judged on; a gap it held past this is a hit
HOL_TTFT_MS = 100.0  # head-of-line: the TTFT target it is judged on; in flight beside a long prefill this long: a hit
TENANTS_TOML = "".join(f'[tenants.{name}]\napi_keys = ["sk-{name}"]\n\n' for name in (*QUIET_TENANTS, NOISY_TENANT))

__all__ = ["KINDS", "MODES", "HOL_TTFT_MS", "PREEMPTED_GAP_MS", "PlantedRun", "Scenario", "SCENARIOS", "build_run", "run_id_of",
           "traced_deployment"]


@dataclass(frozen=True, slots=True)
class Scenario:
    """One planted fault: the server's options and the requests sent."""

    kind: str
    server_args: tuple[str, ...]
    requests: Callable[[str], list[PlannedRequest]]  # key prefix -> the plan's requests, in send order
    cause: str  # the cause it plants, as the diagnosis names it ("none" for the fault-free run)
    modes: tuple[str, ...] = MODES
    stage: str = ""  # slow_stage: the stage planted
    tenant: str = ""  # noisy_neighbour: the noisy tenant
    tenants_file: bool = False


@dataclass(frozen=True)
class PlantedRun:
    """A finished planted run: where it is stored and what the client saw, with the truth.

    ``hit``: keys of the requests the planted fault hit (see the module doc); ``unsure``: keys of those it
    touched too little to call hit or spared (head-of-line and noisy neighbour), counted in neither recall nor
    precision;
    ``long_keys``: the head-of-line run's long prompts (the requests that cause it, not hit by it).
    """

    kind: str
    mode: str
    store: Path
    run: str
    scenario: Scenario
    planned: tuple[PlannedRequest, ...]
    outcomes: tuple[Outcome, ...]
    hit: frozenset[str]
    long_keys: frozenset[str] = field(default_factory=frozenset)
    unsure: frozenset[str] = field(default_factory=frozenset)

    @property
    def cause(self) -> str:
        return self.scenario.cause

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(o.key for o in self.outcomes)

    def client_ttft_ms(self) -> dict[str, float]:
        """Each request's TTFT as the client saw it (send -> first chunk with text), ms."""
        return {o.key: (o.recv_ns[0] - o.send_ns) / 1e6 for o in self.outcomes if o.recv_ns}


def run_id_of(kind: str, mode: str) -> str:
    return f"{kind}-{mode}"


def _text(rng: np.random.Generator, num_tokens: int) -> str:
    return random_text(num_tokens, rng)  # byte-level tokenizer: one ASCII character per token


def _planned(key_prefix: str, rows: list[tuple[float, TextRequest, str]]) -> list[PlannedRequest]:
    """(offset s, text, tenant) rows, sorted by offset, as planned requests keyed ``<prefix>-<i>``."""
    rows = sorted(rows, key=lambda r: r[0])
    return [PlannedRequest(index=i, key=f"{key_prefix}-{i:03d}", text=text, offset_s=offset, tenant=tenant,
                           api_key=f"sk-{tenant}" if tenant else "")
            for i, (offset, text, tenant) in enumerate(rows)]


def _head_of_line(prefix: str) -> list[PlannedRequest]:
    """Short prompts (4 characters, 5 tokens with BOS: one step) every 60 ms; three 480-token prompts 2 s apart,
    each prefilled in 15 chunks of the 32-token budget (about 0.5 s of slept prefill cost): 25-35 short requests
    queue behind them, while the engine stays well under capacity (about half busy) on a busy machine."""
    rng = np.random.default_rng(1)
    rows = [(i * 0.06, TextRequest("", _text(rng, 4), 2), "") for i in range(100)]
    rows += [(t, TextRequest("", _text(rng, 480), 4), "") for t in (0.3, 2.3, 4.3)]
    return _planned(prefix, rows)


def _prefix_miss(prefix: str) -> list[PlannedRequest]:
    rng = np.random.default_rng(2)
    systems = [_text(rng, 440) for _ in range(4)]
    return _planned(prefix, [(i * 0.2, TextRequest(systems[i % 4], _text(rng, 8), 4), "") for i in range(16)])


def _preemption(prefix: str) -> list[PlannedRequest]:
    rng = np.random.default_rng(3)
    return _planned(prefix, [(0.0, TextRequest("", _text(rng, 24), 64), "") for _ in range(10)])


def _steady(seed: int, num: int, rate_rps: float, out_tokens: int = 6) -> Callable[[str], list[PlannedRequest]]:
    def build(prefix: str) -> list[PlannedRequest]:
        rng = np.random.default_rng(seed)
        return _planned(prefix, [(i / rate_rps, TextRequest("", _text(rng, 16), out_tokens), "") for i in range(num)])
    return build


def _noisy_neighbour(prefix: str) -> list[PlannedRequest]:
    rng = np.random.default_rng(5)
    rows = [(0.15 * i + 0.05 * j, TextRequest("", _text(rng, 16), 8), tenant)
            for i in range(20) for j, tenant in enumerate(QUIET_TENANTS)]
    rows += [(1.0 + 0.005 * i, TextRequest("", _text(rng, 16), 8), NOISY_TENANT) for i in range(24)]
    return _planned(prefix, rows)


SCENARIOS: dict[str, Scenario] = {s.kind: s for s in (
    Scenario("head_of_line", ("--max-num-batched-tokens", "32", "--delay", "prefill_token=1ms"), _head_of_line,
             "head_of_line"),
    Scenario("prefix_miss", ("--num-device-blocks", "160", "--max-num-batched-tokens", "32"), _prefix_miss,
             "prefix_miss"),
    Scenario("preemption", ("--num-device-blocks", "110", "--delay", "decode_step=3ms"), _preemption, "preemption"),
    Scenario("kv_transfer", ("--delay", "kv_transfer=40ms"), _steady(4, 10, 4.0), "kv_transfer", modes=("disagg",)),
    Scenario("noisy_neighbour", ("--max-num-seqs", "4", "--delay", "decode_step=10ms"), _noisy_neighbour,
             "noisy_neighbour", tenant=NOISY_TENANT, tenants_file=True),
    Scenario("slow_stage", ("--delay", "stream_send=30ms"), _steady(6, 10, 4.0, out_tokens=8), "slow_stage",
             stage=Stage.STREAM_SEND.label),
    Scenario("overload", ("--max-num-seqs", "1", "--delay", "decode_step=40ms"), _steady(7, 24, 15.0), "overload"),
    Scenario("none", (), _steady(8, 10, 3.0), "none"),
)}


def _mode_args(mode: str) -> list[str]:
    if mode == "colocated":
        return ["--mode", "colocated", "--instances", "1"]
    if mode == "disagg":
        return ["--mode", "disagg", "--prefill", "1", "--decode", "1"]
    raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")


@contextmanager
def traced_deployment(store: Path, run: str, server_args: list[str], *, env: dict[str, str] | None = None,
                      model: str = "tiny") -> Iterator[str]:
    """``tokentrace run -- python -m reference_server ...`` (``model``, CPU, blocks of ``BLOCK_SIZE`` tokens, then
    ``server_args``) as a real process group on a free loopback port, ``env`` added to the environment; yields its
    URL. Stopped with SIGTERM (forwarded by ``tokentrace run``: every process flushes its store), SIGKILL if it
    hangs. The one traced deployment of these tests (tests/instrument/deployments.py and the end-to-end tests use
    it too)."""
    cmd = [sys.executable, "-c", "from tokentrace.app.cli import main; main()", "run", "--store", str(store), "--run", run,
           "--", sys.executable, "-m", "reference_server", "--port", "0", "--model", model, "--device", "cpu",
           "--block-size", str(BLOCK_SIZE), *server_args]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})})
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line.startswith("READY "):
            raise RuntimeError(f"server did not start: {line!r} {proc.stderr.read() if proc.poll() is not None else ''}")  # type: ignore[union-attr]
        yield line.split()[1]
        proc.send_signal(signal.SIGTERM)  # forwarded by tokentrace run; every process flushes its store
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def build_run(store: Path, kind: str, mode: str) -> PlantedRun:
    """Run scenario ``kind`` in ``mode`` into ``store`` (run id ``<kind>-<mode>``) and decide its truth."""
    scenario = SCENARIOS[kind]
    if mode not in scenario.modes:
        raise ValueError(f"{kind} runs only {scenario.modes}")
    run = run_id_of(kind, mode)
    server_args = [*_mode_args(mode), *scenario.server_args]
    if scenario.tenants_file:
        tenants = store / f"{run}-tenants.toml"
        tenants.write_text(TENANTS_TOML)
        server_args += ["--tenants", str(tenants), "--scheduling-policy", "fcfs"]
    planned = tuple(scenario.requests(run))
    plan = Plan(planned, (f"planted {kind}",), {"planted": kind})
    with traced_deployment(store, run, server_args) as url:
        result = run_bench(plan, RequestOptions(url, model="tiny"), RunLimits(duration_s=60, drain_s=60),
                           store=store, run_id=run)
    failed = [(o.key, o.detail) for o in result.outcomes if not o.ok]
    if failed:
        raise RuntimeError(f"{run}: requests failed: {failed[:5]}")
    outcomes = tuple(result.outcomes)
    if kind == "head_of_line":
        hit, unsure, long_keys = _held_behind_long_prefills(store / run, planned, outcomes)
    elif kind == "noisy_neighbour":
        (hit, unsure), long_keys = _behind_the_burst(store / run, planned, outcomes), set()
    else:
        (hit, long_keys), unsure = _truth(kind, store / run, planned, outcomes), set()
    return PlantedRun(kind, mode, store, run, scenario, planned, outcomes, frozenset(hit), frozenset(long_keys),
                      frozenset(unsure))


def _held_behind_long_prefills(run_dir: Path, planned: tuple[PlannedRequest, ...], outcomes: tuple[Outcome, ...]
                               ) -> tuple[set[str], set[str], set[str]]:
    """(hit, unsure, long keys) of the head-of-line run, on the client's clock: a short request's time in flight
    (send to first token) beside a long one's prefill (from the long request's send to the end of its last
    ``prefill.compute`` span in the raw spans, mapped through the instances' clock offsets), the longest such
    overlap; hit at ``HOL_TTFT_MS`` or more (queued behind the long prefill that long, it misses its target on
    that alone), unsure above 0 (sent in the prefill's last moments, or just before it and co-scheduled with its
    first chunk: the long prompt costs it less than its target, and other delays may cost it more)."""
    by_key = {o.key: o for o in outcomes}
    longs = {p.key for p in planned if p.text.num_prompt_tokens > 100}
    prefilled = _prefill_ends(run_dir, longs)
    windows = [(by_key[k].send_ns, prefilled.get(k, by_key[k].recv_ns[0])) for k in longs]
    hit, unsure = set(), set()
    for k, o in by_key.items():
        if k in longs or not o.recv_ns:
            continue
        held_ns = max(min(o.recv_ns[0], hi) - max(o.send_ns, lo) for lo, hi in windows)
        if held_ns >= HOL_TTFT_MS * 1e6:
            hit.add(k)
        elif held_ns > 0:
            unsure.add(k)
    return hit, unsure, longs


def _truth(kind: str, run_dir: Path, planned: tuple[PlannedRequest, ...], outcomes: tuple[Outcome, ...]
           ) -> tuple[set[str], set[str]]:
    """(keys the fault hit, keys of the requests that cause it) from the outcomes and the raw files."""
    by_key = {o.key: o for o in outcomes}
    if kind in ("kv_transfer", "slow_stage"):
        return set(by_key), set()
    if kind == "none":
        return set(), set()
    if kind == "prefix_miss":
        seen: set[str] = set()
        hit = set()
        for p in planned:
            full_blocks_tokens = len(p.text.system) // BLOCK_SIZE * BLOCK_SIZE
            if p.text.system in seen and by_key[p.key].num_cached_tokens < full_blocks_tokens:
                hit.add(p.key)
            seen.add(p.text.system)
        return hit, set()
    if kind == "preemption":
        return _preempted_in_a_gap(run_dir, by_key), set()
    if kind == "overload":
        order = sorted(outcomes, key=lambda o: o.send_ns)
        return {o.key for i, o in enumerate(order) if any(e.finish_ns > o.send_ns for e in order[:i])}, set()
    raise ValueError(f"unknown kind {kind!r}")


def _behind_the_burst(run_dir: Path, planned: tuple[PlannedRequest, ...], outcomes: tuple[Outcome, ...]
                      ) -> tuple[set[str], set[str]]:
    """(hit, unsure) of the noisy-neighbour run, on the client's clock: the quiet tenants' requests sent between
    the burst's first send and the drain of its backlog (:func:`_drained_after` its last finish), hit while one of
    the burst's requests was still in flight (sent, not finished) when they were sent, unsure after that."""
    by_key = {o.key: o for o in outcomes}
    noisy = [by_key[p.key] for p in planned if p.tenant == NOISY_TENANT]
    lo, last = min(o.send_ns for o in noisy), max(o.finish_ns for o in noisy)
    hi = _drained_after(run_dir, last)
    quiet = [by_key[p.key] for p in planned if p.tenant != NOISY_TENANT]
    return ({o.key for o in quiet if lo <= o.send_ns < last},
            {o.key for o in quiet if last <= o.send_ns < hi})


def _preempted_in_a_gap(run_dir: Path, by_key: dict[str, Outcome]) -> set[str]:
    """Keys of the requests a ``schedule.preempted`` span held in a token gap longer than ``PREEMPTED_GAP_MS``: it
    ended after the server had written the request's first chunk, and the server's next write after its end came
    more than ``PREEMPTED_GAP_MS`` after the write before it (the raw tokens' ``sent_ns``; times on the run's
    reference clock, through each instance's clock offset). A preemption that ended before the first chunk, while
    the first tokens were computed or held back for visible text, delayed the TTFT, not a gap; one readmitted
    within a step or two (another request finished just then) left its gap under the target."""
    offsets = _raw_table(run_dir, INSTANCES.name, [col.INSTANCE_ID, col.CLOCK_OFFSET_NS])
    offset = dict(zip(offsets[col.INSTANCE_ID].to_pylist(), offsets[col.CLOCK_OFFSET_NS].to_pylist()))
    tokens = _raw_table(run_dir, TOKENS.name, [col.REQUEST_ID, col.INSTANCE_ID, col.SENT_NS])
    sent: dict[int, list[int]] = {}
    for r, i, t in zip(*(tokens[c].to_pylist() for c in (col.REQUEST_ID, col.INSTANCE_ID, col.SENT_NS))):
        if t is not None:
            sent.setdefault(r, []).append(t + offset[i])
    spans = _raw_table(run_dir, SPANS.name, [col.REQUEST_ID, col.STAGE, col.END_NS, col.INSTANCE_ID])
    ids = _raw_table(run_dir, REQUESTS.name, [col.REQUEST_ID, col.REQUEST_KEY])
    key_of = dict(zip(ids[col.REQUEST_ID].to_pylist(), ids[col.REQUEST_KEY].to_pylist()))
    hit = set()
    for r, stage, end, i in zip(*(spans[c].to_pylist() for c in (col.REQUEST_ID, col.STAGE, col.END_NS,
                                                                 col.INSTANCE_ID))):
        if stage != Stage.SCHEDULE_PREEMPTED or key_of.get(r) not in by_key or r not in sent:
            continue
        end += offset[i]
        before = [t for t in sent[r] if t <= end]
        after = [t for t in sent[r] if t > end]
        if before and after and min(after) - max(before) > PREEMPTED_GAP_MS * 1e6:
            hit.add(key_of[r])
    return hit


def _prefill_ends(run_dir: Path, keys: set[str]) -> dict[str, int]:
    """When each of ``keys``'s last ``prefill.compute`` span ended, on the client's clock (raw spans and instances)."""
    inst = _raw_table(run_dir, INSTANCES.name, [col.INSTANCE_ID, col.ROLE, col.CLOCK_OFFSET_NS])
    offset = dict(zip(inst[col.INSTANCE_ID].to_pylist(), inst[col.CLOCK_OFFSET_NS].to_pylist()))
    client = next(i for i, r in zip(inst[col.INSTANCE_ID].to_pylist(), inst[col.ROLE].to_pylist()) if r == Role.CLIENT)
    ids = _raw_table(run_dir, REQUESTS.name, [col.REQUEST_ID, col.REQUEST_KEY])
    key_of = dict(zip(ids[col.REQUEST_ID].to_pylist(), ids[col.REQUEST_KEY].to_pylist()))
    spans = _raw_table(run_dir, SPANS.name, [col.REQUEST_ID, col.STAGE, col.END_NS, col.INSTANCE_ID])
    ends: dict[str, int] = {}
    for r, stage, end, i in zip(*(spans[c].to_pylist() for c in (col.REQUEST_ID, col.STAGE, col.END_NS,
                                                                 col.INSTANCE_ID))):
        key = key_of.get(r)
        if stage == Stage.PREFILL_COMPUTE and key in keys:
            ends[key] = max(ends.get(key, end), end + offset[i] - offset[client])
    return ends


def _drained_after(run_dir: Path, t_ns: int) -> int:
    """When every engine's waiting queue was first empty at or after ``t_ns`` (the client's clock): the end of
    each engine instance's first step ending then with no request waiting, the latest of them (raw steps, mapped
    onto the client's clock through the instances' clock offsets); ``t_ns`` when every queue was empty by then."""
    inst = _raw_table(run_dir, INSTANCES.name, [col.INSTANCE_ID, col.ROLE, col.CLOCK_OFFSET_NS])
    offset = dict(zip(inst[col.INSTANCE_ID].to_pylist(), inst[col.CLOCK_OFFSET_NS].to_pylist()))
    client = next(i for i, r in zip(inst[col.INSTANCE_ID].to_pylist(), inst[col.ROLE].to_pylist()) if r == Role.CLIENT)
    steps = _raw_table(run_dir, STEPS.name, [col.INSTANCE_ID, col.END_NS, col.NUM_WAITING])
    drained: dict[int, int] = {}
    for i, end, waiting in zip(*(steps[c].to_pylist() for c in (col.INSTANCE_ID, col.END_NS, col.NUM_WAITING))):
        end = end + offset[i] - offset[client]
        if end >= t_ns and waiting == 0:
            drained[i] = min(end, drained.get(i, end))
    return max([t_ns, *drained.values()])


def _raw_table(run_dir: Path, table: str, columns: list[str]) -> pa.Table:
    """Columns of one store table, read straight from its Parquet part files (every instance)."""
    parts = sorted((run_dir / table).glob("*/*.parquet"))
    return pa.concat_tables([pq.read_table(p, columns=columns) for p in parts])
