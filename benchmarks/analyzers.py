"""Benchmark: the stage breakdown over a generated store of >= 10 M span rows, DuckDB vs pandas.

Generates a run in the real store layout (Parquet, ``<store>/<run>/<table>/instance=1/part-*.parquet``
plus ``manifest.json``): ``--requests`` requests (default 100 000) of ``--tokens`` output
tokens (default 25), about four stage spans per token -> 10.1 M span rows, 2.5 M token rows.
As in a disaggregated run, where the engine computes token i while token i-1 is still being
streamed, 10% of the later tokens' decode.queue spans start before their token's interval
(``OVERHANG_SHARE``): only the part inside the interval counts. Then, each in its own child
process so that peak memory is that implementation's alone:

* ``duckdb``: ``tokentrace.open(store).analyze().stage_breakdown()`` -- the analyzers'
  path (DuckDB over the Parquet files, clock alignment, per-token facts, mean and tail shares),
  measured twice: on the part files alone (``duckdb, part files only``: a run nothing has
  derived facts for, such as one a killed process left), then after the run's analysis facts
  were saved the way ``tokentrace run`` saves them when a run closes
  (:func:`analyzers.derivation.derive`, ``<run>/_derived/``; the time that takes is printed);
* ``pandas``: a straightforward pandas implementation of the same definitions (read the
  three tables, token intervals with a grouped shift, spans merged with their token's
  interval and clipped to it, per-token stage sums with a groupby + unstack, shares and the
  slowest-1% tail with nlargest).

Reports the best of ``--repeats`` runs: wall and CPU seconds, span rows/s, peak traced Python
memory (tracemalloc) and peak resident set size (getrusage maxrss, /proc VmHWM) of each, checks
that all three give the same shares (which they would not without the clipping), and removes the
store (about 0.45 GB with the saved facts). Run: ``.venv/bin/python benchmarks/analyzers.py`` (1-3 minutes).
The line before last is the part-files-only ratio (``part_files_breakdown_vs_pandas_speedup=``); the
last line is ``breakdown_vs_pandas_speedup=<pandas seconds / duckdb seconds>`` for the run as
``tokentrace run`` leaves it (facts saved at close).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from tokentrace.schema import INSTANCES, REQUESTS, SPANS, TOKENS, UNATTRIBUTED_LABEL, Role, Stage, col  # noqa: E402
from tokentrace.store.layout import part_name, partition_dir  # noqa: E402
from tokentrace.store.manifest import write_run_manifest  # noqa: E402

RUN_ID = "bench-run"
SHARE_COLUMNS = ["ttft_share", "ttft_tail_share", "itl_share", "itl_tail_share"]
FIRST_STAGES = (Stage.SCHEDULE_QUEUE, Stage.CACHE_LOOKUP, Stage.PREFILL_COMPUTE, Stage.DETOKENIZE, Stage.STREAM_SEND)
OVERHANG_SHARE = 0.1  # of tokens >= 1 whose decode.queue span starts before the token's interval
LATER_STAGES = (Stage.DECODE_QUEUE, Stage.DECODE_COMPUTE, Stage.SCHEDULE_PREEMPTED, Stage.DETOKENIZE,
                Stage.STREAM_SEND)


# ----------------------------------------------------------------------------- generation


def _durations(rng: np.random.Generator, num_requests: int, num_tokens: int) -> np.ndarray:
    """(requests, tokens, 5) stage durations in ns: heavy-tailed queueing, steadier compute."""
    d = np.empty((num_requests, num_tokens, 5), dtype=np.int64)
    d[:, 0, 0] = rng.lognormal(16.0, 1.5, num_requests)  # schedule.queue, ~9 ms median, heavy tail
    d[:, 0, 1] = rng.lognormal(11.0, 0.3, num_requests)  # cache.lookup ~60 us
    d[:, 0, 2] = rng.lognormal(17.0, 0.5, num_requests)  # prefill.compute ~24 ms
    d[:, 1:, 0] = rng.lognormal(13.0, 1.0, (num_requests, num_tokens - 1))  # decode.queue ~0.4 ms
    d[:, 1:, 1] = rng.lognormal(16.2, 0.2, (num_requests, num_tokens - 1))  # decode.compute ~11 ms
    preempt = rng.random((num_requests, num_tokens - 1)) < 0.002  # rare preemptions of ~100 ms
    d[:, 1:, 2] = np.where(preempt, rng.lognormal(18.4, 0.5, (num_requests, num_tokens - 1)), 0)
    d[:, :, 3] = rng.lognormal(10.0, 0.3, (num_requests, num_tokens))  # detokenize ~22 us
    d[:, :, 4] = rng.lognormal(10.5, 0.3, (num_requests, num_tokens))  # stream.send ~36 us
    return d


def generate(store: Path, num_requests: int, num_tokens: int, num_parts: int, seed: int = 0) -> int:
    """Write the run; returns the number of span rows."""
    rng = np.random.default_rng(seed)
    run_dir = store / RUN_ID
    run_dir.mkdir(parents=True)
    write_run_manifest(run_dir, RUN_ID, {"benchmark": "analyzers"})
    rid = np.arange(1, num_requests + 1, dtype=np.int64)
    arrival = np.cumsum(rng.exponential(2e6, num_requests)).astype(np.int64)  # ~500 requests/s
    d = _durations(rng, num_requests, num_tokens)
    gap = rng.integers(0, 2_000, (num_requests, num_tokens))  # unattributed ns at each token's end
    token_len = d.sum(axis=2) + gap
    token_end = arrival[:, None] + np.cumsum(token_len, axis=1)
    token_start = token_end - token_len
    span_end = token_start[:, :, None] + np.cumsum(d, axis=2)
    span_start = span_end - d
    # The engine ran ahead: the span began while the previous token was still being sent.
    ahead = rng.random((num_requests, num_tokens - 1)) < OVERHANG_SHARE
    span_start[:, 1:, 0] -= np.where(ahead, d[:, :-1, 4], 0)  # by the previous stream.send
    stages = np.empty((num_requests, num_tokens, 5), dtype=np.int8)
    stages[:, 0, :] = FIRST_STAGES
    stages[:, 1:, :] = LATER_STAGES
    keep = d > 0  # no zero-length preemption spans
    tok_idx = np.broadcast_to(np.arange(num_tokens, dtype=np.int32)[None, :, None], d.shape)
    spans = {
        col.REQUEST_ID: np.broadcast_to(rid[:, None, None], d.shape)[keep],
        col.STAGE: stages[keep], col.TOKEN_INDEX: tok_idx[keep],
        col.START_NS: span_start[keep], col.END_NS: span_end[keep],
    }
    num_spans = int(keep.sum())
    _write(run_dir, SPANS, spans, num_spans, num_parts)
    _write(run_dir, TOKENS, {
        col.REQUEST_ID: np.repeat(rid, num_tokens),
        col.TOKEN_INDEX: np.tile(np.arange(num_tokens, dtype=np.int32), num_requests),
        col.EMIT_NS: token_end.reshape(-1),
    }, num_requests * num_tokens, max(1, num_parts // 5))
    _write(run_dir, REQUESTS, {
        col.REQUEST_ID: rid, col.REQUEST_KEY: pa.array([f"req-{i}" for i in rid.tolist()]),
        col.TENANT: pa.array(["acme", "globex"] * (num_requests // 2) + ["acme"] * (num_requests % 2)),
        col.SLO_CLASS: pa.array(["interactive"] * num_requests), col.ARRIVAL_NS: arrival,
        col.FINISH_NS: token_end[:, -1], col.STATUS: np.zeros(num_requests, np.int8),
    }, num_requests, 1)
    _write(run_dir, INSTANCES, {col.ROLE: np.array([int(Role.COLOCATED)], np.int8),
                                col.NAME: pa.array(["engine-1"]), col.CLOCK_OFFSET_NS: np.zeros(1, np.int64)}, 1, 1)
    return num_spans


def _write(run_dir: Path, t, data: dict, num_rows: int, num_parts: int) -> None:
    """Write ``data`` (missing columns as nulls, instance 1) as ``num_parts`` Parquet parts of table ``t``."""
    arrays = []
    for c in t.columns:
        if c.name == col.INSTANCE_ID:
            arrays.append(pa.array(np.ones(num_rows, np.int64)))
        elif c.name in data:
            arrays.append(pa.array(data[c.name], type=c.type))
        else:
            arrays.append(pa.nulls(num_rows, type=c.type))
    table = pa.Table.from_arrays(arrays, schema=t.schema)
    folder = partition_dir(run_dir, t.name, 1)
    folder.mkdir(parents=True)
    step = -(-num_rows // num_parts)
    for i in range(num_parts):
        pq.write_table(table.slice(i * step, step), folder / part_name(i + 1), compression="zstd")


# ----------------------------------------------------------------------------- implementations


def run_duckdb(store: Path):
    import tokentrace

    return tokentrace.open(store).analyze().stage_breakdown()


def run_pandas(store: Path):
    """Straightforward pandas: the same definitions as analyzers.stage_breakdown (spans clipped to their token)."""
    import pandas as pd

    def read(name: str, columns: list[str]) -> pd.DataFrame:
        return pd.read_parquet(store / RUN_ID / name, columns=columns)

    c = col
    req = read("requests", [c.REQUEST_ID, c.ARRIVAL_NS])
    tok = read("tokens", [c.REQUEST_ID, c.TOKEN_INDEX, c.EMIT_NS])
    spans = read("spans", [c.REQUEST_ID, c.STAGE, c.TOKEN_INDEX, c.START_NS, c.END_NS])
    arrival = req.groupby(c.REQUEST_ID)[c.ARRIVAL_NS].min().rename("arrival")
    t = tok.groupby([c.REQUEST_ID, c.TOKEN_INDEX])[c.EMIT_NS].min().rename("t_end").reset_index()
    t = t.sort_values([c.REQUEST_ID, c.TOKEN_INDEX])
    t["prev"] = t.groupby(c.REQUEST_ID)["t_end"].shift()
    t = t.join(arrival, on=c.REQUEST_ID)
    t["t_start"] = np.where(t[c.TOKEN_INDEX] == 0, t["arrival"], t["prev"])
    t["lat"] = t["t_end"] - t["t_start"]
    spans = spans[spans[c.TOKEN_INDEX] >= 0].merge(t[[c.REQUEST_ID, c.TOKEN_INDEX, "t_start", "t_end"]],
                                                   on=[c.REQUEST_ID, c.TOKEN_INDEX])
    inside = np.minimum(spans[c.END_NS], spans["t_end"]) - np.maximum(spans[c.START_NS], spans["t_start"])
    spans = spans.assign(dur=inside.clip(lower=0))
    per = spans.groupby([c.REQUEST_ID, c.TOKEN_INDEX, c.STAGE])["dur"].sum().unstack(fill_value=0)
    per.columns = [Stage(int(s)).label for s in per.columns]
    t = t.merge(per.reset_index(), on=[c.REQUEST_ID, c.TOKEN_INDEX], how="left")
    labels = [s.label for s in Stage]
    for label in labels:
        t[label] = t[label].fillna(0) if label in t else 0
    t[UNATTRIBUTED_LABEL] = t["lat"] - t[labels].sum(axis=1)
    labels.append(UNATTRIBUTED_LABEL)
    out = pd.DataFrame({"stage": labels})
    for kind, rows in (("ttft", t[t[c.TOKEN_INDEX] == 0]), ("itl", t[t[c.TOKEN_INDEX] > 0])):
        tail = rows.nlargest(max(1, int(np.ceil(len(rows) * 0.01))), "lat")
        out[f"{kind}_mean_ms"] = (rows[labels].mean() / 1e6).to_numpy()
        out[f"{kind}_share"] = (rows[labels].sum() / rows["lat"].sum()).to_numpy()
        out[f"{kind}_tail_share"] = (tail[labels].sum() / tail["lat"].sum()).to_numpy()
    return out


def _vm_hwm_mb() -> float:
    """Peak resident set of this process image (Linux VmHWM; unlike ru_maxrss it restarts at exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def child(impl: str, store: Path, repeats: int) -> None:
    """Run one implementation ``repeats`` times; print a JSON line: best wall and CPU seconds, memory, shares."""
    fn = {"duckdb": run_duckdb, "pandas": run_pandas}[impl]
    import pandas  # noqa: F401

    import analyzers.analysis  # noqa: F401 - imports are not part of the measured time

    walls, cpus, traced = [], [], 0
    for _ in range(repeats):
        tracemalloc.start()
        t0, c0 = time.perf_counter(), time.process_time()
        df = fn(store)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        traced = max(traced, tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    maxrss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: KiB
    shares = df.set_index("stage")[SHARE_COLUMNS].to_numpy().tolist()
    print(json.dumps({"seconds": min(walls), "first_seconds": walls[0], "cpu_seconds": min(cpus), "traced_peak_mb": traced / 2**20,
                      "maxrss_mb": maxrss_kb / 1024, "hwm_mb": _vm_hwm_mb(), "shares": shares}))


def _measure(impl: str, store: Path, repeats: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", impl, "--store", str(store), "--repeats", str(repeats)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--tokens", type=int, default=25)
    p.add_argument("--parts", type=int, default=20, help="span part files")
    p.add_argument("--repeats", type=int, default=2, help="runs per implementation; the best is reported")
    p.add_argument("--child", choices=("duckdb", "pandas", "generate", "derive"), help=argparse.SUPPRESS)
    p.add_argument("--store", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child == "generate":  # in a child, so the parent's resident set stays small
        print(generate(args.store, args.requests, args.tokens, args.parts))
        return
    if args.child == "derive":  # what tokentrace run does when the traced command has ended
        import tokentrace
        from analyzers.derivation import derive

        t0 = time.perf_counter()
        written = derive(tokentrace.open(args.store))
        print(json.dumps({"seconds": time.perf_counter() - t0, "facts": written}))
        return
    if args.child:
        child(args.child, args.store, args.repeats)
        return
    print(f"machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, load average {os.getloadavg()[0]:.1f}")
    tmp = Path(tempfile.mkdtemp(prefix="tokentrace-bench-analyzers-"))
    store = tmp / "store"
    try:
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, __file__, "--child", "generate", "--store", str(store),
                              "--requests", str(args.requests), "--tokens", str(args.tokens),
                              "--parts", str(args.parts)], check=True, capture_output=True, text=True)
        num_spans = int(out.stdout.strip().splitlines()[-1])
        size = sum(f.stat().st_size for f in store.rglob("*.parquet"))
        print(f"generated {num_spans:,} span rows, {args.requests * args.tokens:,} token rows, "
              f"{args.requests:,} requests: {size / 2**20:.0f} MiB of Parquet in {time.perf_counter() - t0:.1f} s")
        results = {"duckdb, part files only": _measure("duckdb", store, args.repeats)}
        out = subprocess.run([sys.executable, __file__, "--child", "derive", "--store", str(store)],
                             check=True, capture_output=True, text=True)
        derived = json.loads(out.stdout.strip().splitlines()[-1])
        size = sum(f.stat().st_size for f in store.rglob("_derived/*.parquet"))
        print(f"saved the run's analysis facts as tokentrace run does at close ({len(derived['facts'])} tables, "
              f"{size / 2**20:.0f} MiB) in {derived['seconds']:.1f} s")
        results.update({impl: _measure(impl, store, args.repeats) for impl in ("duckdb", "pandas")})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"best of {args.repeats} runs each; memory: tracemalloc peak (Python allocations), "
          "maxrss (getrusage) and VmHWM (peak resident set of the process image)")
    for impl, r in results.items():
        print(f"{impl:>23}: {r['seconds']:6.2f} s wall (first run {r['first_seconds']:6.2f} s) "
              f"{r['cpu_seconds']:6.2f} s CPU  "
              f"{num_spans / r['seconds'] / 1e6:5.2f} M span rows/s  traced peak {r['traced_peak_mb']:7.1f} MiB  "
              f"maxrss {r['maxrss_mb']:7.1f} MiB  VmHWM {r['hwm_mb']:7.1f} MiB")
    pandas = results["pandas"]
    for impl in ("duckdb, part files only", "duckdb"):
        diff = float(np.nanmax(np.abs(np.array(results[impl]["shares"], float) - np.array(pandas["shares"], float))))
        print(f"largest share difference between {impl} and pandas: {diff:.2e}")
        if not diff < 1e-9:
            raise SystemExit(f"{impl} and pandas disagree (max share difference {diff})")
    for impl in ("duckdb, part files only", "duckdb"):
        r = results[impl]
        print(f"{impl}: CPU-time ratio pandas / duckdb {pandas['cpu_seconds'] / r['cpu_seconds']:.2f}; "
              f"first-run (cold process) wall ratio {pandas['first_seconds'] / r['first_seconds']:.2f}")
    raw = results["duckdb, part files only"]
    print(f"part_files_breakdown_vs_pandas_speedup={pandas['seconds'] / raw['seconds']:.2f}")
    print(f"breakdown_vs_pandas_speedup={pandas['seconds'] / results['duckdb']['seconds']:.2f}")

if __name__ == "__main__":
    main()
