"""Benchmark: the stage breakdown at scale, DuckDB (embedded) against Spark (local mode), 10 M to 100 M span rows.

For each size in ``--spans`` (default ``10M,100M``) a run is generated in the store's own
layout by the store's own writer (``tokentrace.store.StoreWriter``: one Parquet part per
``write``, ``<store>/<run>/<table>/instance=<id>/part-<n>.parquet`` plus the manifest),
``--requests-per-part`` requests at a time, so the generator never holds more than one part
in memory. Each request has ``--tokens`` output tokens (default 25) and about four stage
spans per token (about 101 span rows a request); 10% of the later tokens' decode.queue spans
start before their token's interval, so the clipping matters. Then, each in its own child
process (so that peak memory is that engine's alone):

* ``duckdb``: ``tokentrace.open(store).analyze().stage_breakdown()``;
* ``spark``: ``tokentrace.open(store, engine="spark").analyze().stage_breakdown()`` on a
  ``local[*]`` session (``--spark-memory`` for the driver, the one JVM in local mode), the
  same SQL translated by SQLGlot.

For each: seconds (the analysis alone; Spark's JVM start-up is given apart), span rows/s,
peak resident memory of the Python process (Linux VmHWM) and, for Spark, of the JVM. The two
engines' shares must agree (checked). Then how the cost grows from the smallest size to the
largest: seconds per row and peak memory, per engine. Stores are removed after each size
(``--keep`` keeps them); ``--dir`` chooses where they go (100 M span rows take about 2.5 GB).

Run small: ``.venv/bin/python benchmarks/scale.py --spans 1M,3M`` (a minute or two).
The full run (``--spans 10M,100M``) takes about an hour on two busy cores.
The last line is ``spark_vs_duckdb_rows_per_s=<Spark span rows/s / DuckDB span rows/s at the largest size>``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402

from tokentrace.schema import INSTANCES, REQUESTS, SPANS, TOKENS, Role, Stage, col  # noqa: E402

RUN_ID = "scale-run"
SHARE_COLUMNS = ["ttft_share", "ttft_tail_share", "itl_share", "itl_tail_share"]
FIRST_STAGES = (Stage.SCHEDULE_QUEUE, Stage.CACHE_LOOKUP, Stage.PREFILL_COMPUTE, Stage.DETOKENIZE, Stage.STREAM_SEND)
LATER_STAGES = (Stage.DECODE_QUEUE, Stage.DECODE_COMPUTE, Stage.SCHEDULE_PREEMPTED, Stage.DETOKENIZE,
                Stage.STREAM_SEND)
OVERHANG_SHARE = 0.1  # of tokens >= 1 whose decode.queue span starts before the token's interval
SPANS_PER_REQUEST_GUESS = 101  # 5 token-0 spans + 4 per later token (+ rare preemptions), 25 tokens


def parse_count(text: str) -> int:
    """``10M`` / ``2.5k`` / ``100000000`` -> an int."""
    t = text.strip().upper()
    scale = {"K": 1_000, "M": 1_000_000, "G": 1_000_000_000}.get(t[-1:], 1)
    number = float(t[:-1] if scale > 1 else t)
    if not math.isfinite(number) or number <= 0:
        raise argparse.ArgumentTypeError(f"not a positive count: {text!r}")
    return int(number * scale)


# ----------------------------------------------------------------------------- generation


def _part(rng: np.random.Generator, first_rid: int, t0: int, num_requests: int, num_tokens: int):
    """One part's columns (spans, tokens, requests) for requests ``first_rid``.. arriving from ``t0``."""
    rid = np.arange(first_rid, first_rid + num_requests, dtype=np.int64)
    arrival = t0 + np.cumsum(rng.exponential(2e6, num_requests)).astype(np.int64)  # ~500 requests/s
    d = np.empty((num_requests, num_tokens, 5), dtype=np.int64)  # stage durations, ns
    d[:, 0, 0] = rng.lognormal(16.0, 1.5, num_requests)  # schedule.queue, heavy tail
    d[:, 0, 1] = rng.lognormal(11.0, 0.3, num_requests)  # cache.lookup
    d[:, 0, 2] = rng.lognormal(17.0, 0.5, num_requests)  # prefill.compute
    d[:, 1:, 0] = rng.lognormal(13.0, 1.0, (num_requests, num_tokens - 1))  # decode.queue
    d[:, 1:, 1] = rng.lognormal(16.2, 0.2, (num_requests, num_tokens - 1))  # decode.compute
    preempt = rng.random((num_requests, num_tokens - 1)) < 0.002
    d[:, 1:, 2] = np.where(preempt, rng.lognormal(18.4, 0.5, (num_requests, num_tokens - 1)), 0)
    d[:, :, 3] = rng.lognormal(10.0, 0.3, (num_requests, num_tokens))  # detokenize
    d[:, :, 4] = rng.lognormal(10.5, 0.3, (num_requests, num_tokens))  # stream.send
    token_len = d.sum(axis=2) + rng.integers(0, 2_000, (num_requests, num_tokens))  # + unattributed gap
    token_end = arrival[:, None] + np.cumsum(token_len, axis=1)
    token_start = token_end - token_len
    span_end = token_start[:, :, None] + np.cumsum(d, axis=2)
    span_start = span_end - d
    ahead = rng.random((num_requests, num_tokens - 1)) < OVERHANG_SHARE  # the engine ran ahead of the stream
    span_start[:, 1:, 0] -= np.where(ahead, d[:, :-1, 4], 0)
    stages = np.empty((num_requests, num_tokens, 5), dtype=np.int8)
    stages[:, 0, :] = FIRST_STAGES
    stages[:, 1:, :] = LATER_STAGES
    keep = d > 0
    tok_idx = np.broadcast_to(np.arange(num_tokens, dtype=np.int32)[None, :, None], d.shape)
    spans = {col.REQUEST_ID: np.broadcast_to(rid[:, None, None], d.shape)[keep], col.STAGE: stages[keep],
             col.TOKEN_INDEX: tok_idx[keep], col.START_NS: span_start[keep], col.END_NS: span_end[keep]}
    tokens = {col.REQUEST_ID: np.repeat(rid, num_tokens),
              col.TOKEN_INDEX: np.tile(np.arange(num_tokens, dtype=np.int32), num_requests),
              col.EMIT_NS: token_end.reshape(-1)}
    requests = {col.REQUEST_ID: rid, col.REQUEST_KEY: pa.array([f"req-{i}" for i in rid.tolist()]),
                col.TENANT: pa.array(np.where(rid % 2 == 0, "acme", "globex")),
                col.SLO_CLASS: pa.array(["interactive"] * num_requests), col.ARRIVAL_NS: arrival,
                col.FINISH_NS: token_end[:, -1], col.STATUS: np.zeros(num_requests, np.int8)}
    return spans, tokens, requests, int(arrival[-1])


def _table(t, data: dict, instance_id: int) -> pa.Table:
    """``data`` as a table of schema ``t`` (missing columns null, every row on ``instance_id``)."""
    n = len(next(iter(data.values())))
    arrays = []
    for c in t.columns:
        if c.name == col.INSTANCE_ID:
            arrays.append(pa.array(np.full(n, instance_id, np.int64)))
        elif c.name in data:
            arrays.append(pa.array(data[c.name], type=c.type))
        else:
            arrays.append(pa.nulls(n, type=c.type))
    return pa.Table.from_arrays(arrays, schema=t.schema)


def generate(store: Path, target_spans: int, num_tokens: int, requests_per_part: int, seed: int = 0) -> int:
    """Write a run of about ``target_spans`` span rows, one part per ``requests_per_part`` requests."""
    from tokentrace.store import StoreWriter

    rng = np.random.default_rng(seed)
    num_requests = max(1, round(target_spans / SPANS_PER_REQUEST_GUESS))
    num_spans = 0
    with StoreWriter(store, run_id=RUN_ID, config={"benchmark": "scale"}, journal=False) as writer:
        iid = writer.instance_id
        writer.register_instance(iid, Role.COLOCATED, "engine-1")
        writer.write(INSTANCES, _table(INSTANCES, {col.ROLE: np.array([int(Role.COLOCATED)], np.int8),
                                                   col.NAME: pa.array(["engine-1"]),
                                                   col.CLOCK_OFFSET_NS: np.zeros(1, np.int64)}, iid))
        done, t0 = 0, 0
        while done < num_requests:
            n = min(requests_per_part, num_requests - done)
            spans, tokens, requests, t0 = _part(rng, done + 1, t0, n, num_tokens)
            writer.write(SPANS, _table(SPANS, spans, iid))
            writer.write(TOKENS, _table(TOKENS, tokens, iid))
            writer.write(REQUESTS, _table(REQUESTS, requests, iid))
            num_spans += len(spans[col.REQUEST_ID])
            done += n
    return num_spans


# ----------------------------------------------------------------------------- measuring (child processes)


def _vm_hwm_mb(pid: int | str = "self") -> float:
    """Peak resident set of a process (Linux VmHWM), MB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _java_descendants() -> list[int]:
    """Pids of the java processes below this one (the JVM PySpark started)."""
    parent: dict[int, int] = {}
    comm: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            parent[int(entry.name)] = int(fields[1])
            comm[int(entry.name)] = (entry / "comm").read_text().strip()
        except (OSError, IndexError, ValueError):
            continue
    me, found = os.getpid(), []
    for pid in parent:
        p = pid
        while p in parent and p not in (0, 1, me):
            p = parent[p]
        if p == me and comm.get(pid) == "java":
            found.append(pid)
    return found


def child(engine: str, store: Path, spark_memory: str, local_dir: Path) -> None:
    """Run the stage breakdown once on ``engine``; print one JSON line of figures and shares."""
    import tokentrace

    startup = 0.0
    kwargs: dict = {}
    if engine == "spark":
        from analyzers.spark_engine import spark_session

        t = time.perf_counter()
        spark_session("local[*]", {"spark.driver.memory": spark_memory, "spark.local.dir": str(local_dir)})
        startup = time.perf_counter() - t
        kwargs = {"engine": "spark"}
    cpu0, t0 = time.process_time(), time.perf_counter()
    bd = tokentrace.open(store, **kwargs).analyze().stage_breakdown()
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    jvm = max((_vm_hwm_mb(p) for p in _java_descendants()), default=float("nan"))
    print(json.dumps({"engine": engine, "wall_s": wall, "startup_s": startup, "python_cpu_s": cpu,
                      "python_peak_mb": _vm_hwm_mb(), "jvm_peak_mb": jvm,
                      "shares": bd.set_index("stage")[SHARE_COLUMNS].to_dict()}))


def measure(engine: str, store: Path, spark_memory: str, local_dir: Path) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", engine, "--store", str(store),
                          "--spark-memory", spark_memory, "--local-dir", str(local_dir)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{engine} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- main


def _same_shares(a: dict, b: dict) -> float:
    """Largest absolute difference between two engines' shares."""
    worst = 0.0
    for column in SHARE_COLUMNS:
        for stage, v in a[column].items():
            w = b[column][stage]
            if v is None or w is None or (isinstance(v, float) and math.isnan(v)):
                continue
            worst = max(worst, abs(v - w))
    return worst


def _growth(results: list[tuple[int, dict[str, dict]]], engines: list[str]) -> None:
    """How the cost grew from the smallest size to the latest one, per engine."""
    (small, first), (big, last) = results[0], results[-1]
    if big <= small:
        return
    for engine in engines:
        per_row = (last[engine]["wall_s"] / big) / (first[engine]["wall_s"] / small)
        mem = "python_peak_mb" if engine == "duckdb" else "jvm_peak_mb"
        print(f"{engine}: {big / small:.1f}x the rows took {last[engine]['wall_s'] / first[engine]['wall_s']:.1f}x "
              f"the time ({per_row:.2f}x the time per row; 1.0 = linear); peak memory "
              f"{first[engine][mem]:.0f} -> {last[engine][mem]:.0f} MB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spans", default="10M,100M",
                    help="comma-separated span row counts, smallest first (e.g. 1M,3M; default 10M,100M)")
    ap.add_argument("--tokens", type=int, default=25, help="output tokens per request")
    ap.add_argument("--requests-per-part", type=int, default=20_000, help="requests per Parquet part (~2 M spans)")
    ap.add_argument("--engines", default="duckdb,spark", help="comma-separated: duckdb, spark")
    ap.add_argument("--spark-memory", default="4g", help="Spark driver memory (local mode: the JVM's heap)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write the stores (default: a temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep the generated stores")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--store", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--local-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.store, args.spark_memory, args.local_dir)
        return
    try:
        sizes = [parse_count(s) for s in args.spans.split(",") if s.strip()]
    except argparse.ArgumentTypeError as err:
        ap.error(str(err))
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not sizes or not set(engines) <= {"duckdb", "spark"} or not engines:
        ap.error("--spans needs at least one size; --engines takes duckdb and/or spark")
    if args.tokens < 2 or args.requests_per_part < 1:
        ap.error("--tokens must be >= 2 and --requests-per-part >= 1")
    print(f"# {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}")
    base = Path(tempfile.mkdtemp(prefix="tokentrace-scale-", dir=args.dir))
    results: list[tuple[int, dict[str, dict]]] = []
    try:
        for size in sizes:
            store = base / f"store-{size}"
            t = time.perf_counter()
            num_spans = generate(store, size, args.tokens, args.requests_per_part)
            on_disk = sum(p.stat().st_size for p in store.rglob("*") if p.is_file()) / 1e9
            print(f"generated {num_spans:,} span rows ({on_disk:.2f} GB) in {time.perf_counter() - t:.0f} s")
            row: dict[str, dict] = {}
            for engine in engines:
                local_dir = base / "spark-local"
                local_dir.mkdir(exist_ok=True)
                r = measure(engine, store, args.spark_memory, local_dir)
                r["rows_per_s"] = num_spans / r["wall_s"]
                row[engine] = r
                jvm = f", JVM peak {r['jvm_peak_mb']:.0f} MB (start-up {r['startup_s']:.1f} s)" if engine == "spark" else ""
                print(f"{num_spans:>13,} spans  {engine:<6} {r['wall_s']:8.1f} s  {r['rows_per_s'] / 1e6:6.2f} M rows/s  "
                      f"Python peak {r['python_peak_mb']:.0f} MB{jvm}", flush=True)
            if len(row) == 2:
                worst = _same_shares(row["duckdb"]["shares"], row["spark"]["shares"])
                print(f"{'':13}  shares agree to {worst:.1e}")
                if worst > 1e-9:
                    raise SystemExit(f"the engines' shares differ by {worst}")
            results.append((num_spans, row))
            if not args.keep:
                shutil.rmtree(store, ignore_errors=True)
            _growth(results, engines)
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)
    last = results[-1][1]
    if {"duckdb", "spark"} <= set(engines):
        print(f"spark_vs_duckdb_rows_per_s={last['spark']['rows_per_s'] / last['duckdb']['rows_per_s']:.3f}")
    else:
        print(f"{engines[0]}_rows_per_s={last[engines[0]]['rows_per_s']:.0f}")


if __name__ == "__main__":
    main()
