"""Benchmark: cost of recording one span, against OpenTelemetry and a bare array append.

Measures, in one process (ns per event, median of repeated runs of a loop of
``--events`` calls, loop overhead included in every figure alike):

* ``recorder.span``: the tokentrace hot path (``Recorder.span`` bound method);
* ``otel span``: ``tracer.start_span`` + one attribute + ``end`` into a
  ``BatchSpanProcessor`` whose exporter does nothing but return SUCCESS;
* bare ``array('q')`` appends of the same nine int64 fields: nine
  ``append`` calls (the literal baseline), one ``extend`` with a tuple, and one
  ``frombytes(Struct.pack(...))`` (the recorder's own technique, without cap
  check or method call);
* the manual API while unbound (``tokentrace.api.span``: a no-op) and bound;
* the flush path: rows/s turned into zstd Parquet files in a temp dir, both
  while a producer thread keeps recording and for the flush alone.

Run: ``.venv/bin/python benchmarks/recorder.py`` (about 30 s). The last line is
``recorder_vs_otel_span_speedup=<otel ns / recorder ns>``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import struct
import sys
import tempfile
import threading
import time
from array import array
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402

from tokentrace import api  # noqa: E402
from tokentrace.recorder import BufferedRecorder, Recorder  # noqa: E402
from tokentrace.schema import SPANS, Stage, Table  # noqa: E402

STAGE = int(Stage.DECODE_COMPUTE)


class NullSink:
    """Discards batches: isolates the hot path from any I/O."""

    def write(self, table: Table, batch: pa.RecordBatch) -> None:
        pass

    def close(self) -> None:
        pass


class ParquetSink:
    """Writes every batch as its own zstd Parquet file (what the store does)."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)
        self.num_files = 0
        self.num_rows = 0

    def write(self, table: Table, batch: pa.RecordBatch) -> None:
        self.num_files += 1
        path = self.folder / f"{table.name}-{self.num_files:06d}.parquet"
        pq.write_table(pa.Table.from_batches([batch]), path, compression="zstd")
        self.num_rows += batch.num_rows

    def close(self) -> None:
        pass


def per_event_ns(loops: dict[str, tuple[Callable[[int], None], int]], repeats: int) -> dict[str, float]:
    """Median ns per call of each ``loop(n)`` over ``repeats`` rounds.

    Rounds run every loop once, in turn, so a change in machine load during
    the benchmark hits all figures alike instead of skewing their ratios.
    """
    runs: dict[str, list[float]] = {name: [] for name in loops}
    for loop, n in loops.values():
        loop(min(n, 10_000))  # warm up (specialization, allocations)
    for _ in range(repeats):
        for name, (loop, n) in loops.items():
            t0 = time.perf_counter_ns()
            loop(n)
            runs[name].append((time.perf_counter_ns() - t0) / n)
    return {name: statistics.median(r) for name, r in runs.items()}


def recorder_loop(rec: Recorder) -> Callable[[int], None]:
    def loop(n: int) -> None:
        span = rec.span
        for i in range(n):
            span(7, STAGE, i, i + 5, 3)

    return loop


def otel_loop() -> tuple[Callable[[int], None], Callable[[], None]]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class NoopExporter(SpanExporter):
        def export(self, spans):  # noqa: ANN001 - OTel's signature
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(NoopExporter()))
    tracer = provider.get_tracer("tokentrace.benchmark")
    name = Stage.DECODE_COMPUTE.label

    def loop(n: int) -> None:
        start_span = tracer.start_span
        for i in range(n):
            s = start_span(name, start_time=i)
            s.set_attribute("tokentrace.token", 3)
            s.end(end_time=i + 5)

    return loop, provider.shutdown


def bare_append_loop(n: int) -> None:
    a = array("q")
    ap = a.append
    for i in range(n):
        ap(7); ap(STAGE); ap(3); ap(i); ap(i + 5); ap(-1); ap(-1); ap(-1); ap(-1)  # noqa: E702


def bare_extend_loop(n: int) -> None:
    a = array("q")
    ext = a.extend
    for i in range(n):
        ext((7, STAGE, 3, i, i + 5, -1, -1, -1, -1))


def bare_pack_loop(n: int) -> None:
    a = array("q")
    put = a.frombytes
    pack = struct.Struct("=9q").pack
    for i in range(n):
        put(pack(7, STAGE, 3, i, i + 5, -1, -1, -1, -1))


def api_loop(n: int) -> None:
    span = api.span
    for i in range(n):
        span(7, STAGE, i, i + 5, 3)


def flush_concurrent(seconds: float) -> tuple[float, float, int, int]:
    """Flush figures with a producer thread recording spans throughout the run.

    Returns (rows written per wall second, rows recorded per wall second, rows
    dropped, most rows buffered at once). Written = recorded with nothing
    dropped means the flush kept up with the producer; the buffer high-water
    mark shows by how much it lagged.
    """
    with tempfile.TemporaryDirectory() as d:
        sink = ParquetSink(d)
        rec = BufferedRecorder(sink, instance_id=1, memory_cap_bytes=1 << 30, flush_interval_s=0.25)
        stop = threading.Event()
        produced = [0]

        def produce() -> None:
            span = rec.span
            i = 0
            while not stop.is_set():
                for _ in range(10_000):
                    span(7, STAGE, i, i + 5, 3)
                    i += 1
            produced[0] = i

        t0 = time.perf_counter()
        th = threading.Thread(target=produce)
        th.start()
        max_buffered = 0
        while time.perf_counter() - t0 < seconds:  # the measured window
            time.sleep(0.05)
            max_buffered = max(max_buffered, rec.counters["buffered"])
        stop.set()
        th.join()
        rec.close()
        elapsed = time.perf_counter() - t0
        c = rec.counters
        assert sink.num_rows == c[SPANS.name] == produced[0] - c["dropped"], c
        return sink.num_rows / elapsed, produced[0] / elapsed, c["dropped"], max_buffered


def flush_alone(num_rows: int) -> float:
    """Rows per wall second of ``Recorder.flush`` turning buffered spans into zstd Parquet."""
    with tempfile.TemporaryDirectory() as d:
        sink = ParquetSink(d)
        rec = BufferedRecorder(sink, instance_id=1, memory_cap_bytes=1 << 30, flush_interval_s=3600)
        recorder_loop(rec)(num_rows)
        t0 = time.perf_counter()
        rec.flush()
        elapsed = time.perf_counter() - t0
        rec.close()
        assert sink.num_rows == num_rows
        return num_rows / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--events", type=int, default=200_000, help="calls per timed run")
    p.add_argument("--repeats", type=int, default=7, help="timed runs per figure (median)")
    p.add_argument("--flush-seconds", type=float, default=3.0, help="producer run time for the flush figure")
    args = p.parse_args()
    n, k = args.events, args.repeats

    rec = BufferedRecorder(NullSink(), instance_id=1, memory_cap_bytes=1 << 30, flush_interval_s=0.25)
    otel, otel_shutdown = otel_loop()
    bound = BufferedRecorder(NullSink(), instance_id=2, memory_cap_bytes=1 << 30, flush_interval_s=0.25)

    def bound_api_loop(m: int) -> None:
        api.bind(bound)
        try:
            api_loop(m)
        finally:
            api.unbind()

    figures = per_event_ns({
        "recorder.span": (recorder_loop(rec), n),
        "otel span (1 attribute, batch processor)": (otel, max(1, n // 8)),
        "bare array: 9 x append": (bare_append_loop, n),
        "bare array: extend(tuple)": (bare_extend_loop, n),
        "bare array: frombytes(pack)": (bare_pack_loop, n),
        "api.span, unbound (no-op)": (api_loop, n),
        "api.span, bound": (bound_api_loop, n),
    }, k)
    rec.close()
    bound.close()
    otel_shutdown()
    written_per_s, recorded_per_s, dropped, max_buffered = flush_concurrent(args.flush_seconds)
    alone_per_s = flush_alone(1_000_000)

    print(f"machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()} ({platform.python_implementation()})")
    print(f"{'ns per event (median of ' + str(k) + ' runs)':<44} {'ns':>8}")
    for name, ns in figures.items():
        print(f"  {name:<42} {ns:8.1f}")
    rec_ns = figures["recorder.span"]
    otel_ns = figures["otel span (1 attribute, batch processor)"]
    print(f"  recorder vs 9 x append: {rec_ns / figures['bare array: 9 x append']:.2f}x, "
          f"vs extend(tuple): {rec_ns / figures['bare array: extend(tuple)']:.2f}x, "
          f"vs frombytes(pack): {rec_ns / figures['bare array: frombytes(pack)']:.2f}x")
    print(f"flush into zstd Parquet while recording: {written_per_s / 1e6:.2f} M rows/s written "
          f"= {recorded_per_s / 1e6:.2f} M rows/s recorded by the producer, {dropped} dropped, "
          f"at most {max_buffered} rows buffered")
    print(f"flush into zstd Parquet alone (1M buffered spans): {alone_per_s / 1e6:.2f} M rows/s")
    print(f"recorder_vs_otel_span_speedup={otel_ns / rec_ns:.1f}")


if __name__ == "__main__":
    main()
