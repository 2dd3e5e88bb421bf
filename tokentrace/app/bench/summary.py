"""The final summary, with the metric names and definitions of ``vllm bench serve``.

Definitions (per successful request; times on the client's monotonic clock):

* TTFT = first token chunk received - request sent;
* E2EL = end of the answer ([DONE] received) - request sent;
* TPOT = (E2EL - TTFT) / (output tokens - 1), requests with more than one output token;
* ITL = gap between consecutive token chunks, every gap of every request;
* duration = first send -> last response, seconds; request throughput = completed / duration;
  output token throughput = output tokens / duration; total token throughput adds input tokens;
* goodput = completed requests that meet every ``--slo`` target (ttft, tpot, e2el, in ms) / duration;
* send lag = request sent - when the plan said it was due (run start + its offset), every request
  sent and not cancelled. Not in ``vllm bench serve``: under an open loop it says whether the client
  kept to the arrival schedule (a lagging client under-drives the server, and the latencies above
  then describe a lighter load than planned); under ``--concurrency`` it is the wait for a free slot.

Output tokens are the server's ``usage.completion_tokens`` when it reports it, else the
chunks counted; input tokens likewise ``usage.prompt_tokens`` or the planned length. JSON
keys follow vLLM: ``mean_ttft_ms``, ``median_ttft_ms``, ``std_ttft_ms``, ``p99_ttft_ms``, ...
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from tokentrace.app.bench.requests import FailureKind, Outcome, PlannedRequest

__all__ = ["METRICS", "SLO_METRICS", "parse_slo", "BenchSummary", "summarize", "render_text", "percentile_key"]

METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
SLO_METRICS: tuple[str, ...] = ("ttft", "tpot", "e2el")
_TITLES = {"ttft": ("Time to First Token", "TTFT"), "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
           "itl": ("Inter-token Latency", "ITL"), "e2el": ("End-to-end Latency", "E2EL")}
_UNITS_MS = {"ms": 1.0, "s": 1000.0, "us": 0.001, "": 1.0}


def parse_slo(spec: str) -> dict[str, float]:
    """Parse ``ttft=500ms,tpot=50ms[,e2el=2s]`` into milliseconds per metric (bare numbers are ms)."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        name, eq, value = part.partition("=")
        name = name.strip().lower()
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s|us)?\s*", value)
        if not eq or name not in SLO_METRICS or m is None:
            raise ValueError(f"bad --slo entry {part!r}; expected e.g. ttft=500ms,tpot=50ms "
                             f"(metrics: {', '.join(SLO_METRICS)}; units ms, s, us)")
        out[name] = float(m.group(1)) * _UNITS_MS[m.group(2) or ""]
        if out[name] <= 0:
            raise ValueError(f"--slo {name} must be positive")
    return out


def percentile_key(p: float) -> str:
    """vLLM's percentile word: 99 -> '99', 99.9 -> '99.9'."""
    return str(int(p)) if float(p).is_integer() else str(p)


@dataclass(frozen=True, slots=True)
class BenchSummary:
    """Everything the final printout and ``--output json`` show."""

    num_sent: int
    num_planned: int  # requests in the plan; the difference was not sent (duration bound)
    completed: int
    failures: dict[str, int]  # FailureKind label -> count (every kind present)
    num_cancelled: int  # in flight at the duration bound
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    samples_ms: dict[str, np.ndarray]  # metric -> samples
    percentiles: tuple[float, ...]
    slo_ms: dict[str, float] = field(default_factory=dict)
    num_good: int = 0
    settings: dict[str, Any] = field(default_factory=dict)  # run settings echoed in JSON
    send_lag_ms: np.ndarray | None = None  # per request sent; None when the run's start is unknown

    @property
    def num_failed(self) -> int:
        return sum(self.failures.values())

    def as_dict(self) -> dict[str, Any]:
        """The JSON document (vLLM's keys plus failures per kind and the settings)."""
        d = max(self.duration_s, 1e-9)
        out: dict[str, Any] = {
            "duration": self.duration_s, "num_prompts": self.num_sent, "not_sent": self.num_planned - self.num_sent,
            "completed": self.completed,
            "failed": self.num_failed, "failures": dict(self.failures), "cancelled": self.num_cancelled,
            "total_input_tokens": self.total_input_tokens, "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.completed / d,
            "request_goodput": self.num_good / d if self.slo_ms else None,
            "output_throughput": self.total_output_tokens / d,
            "total_token_throughput": (self.total_input_tokens + self.total_output_tokens) / d,
        }
        for m in METRICS:
            v = self.samples_ms.get(m, np.empty(0))
            out[f"mean_{m}_ms"] = _stat(np.mean, v)
            out[f"median_{m}_ms"] = _stat(np.median, v)
            out[f"std_{m}_ms"] = _stat(np.std, v)
            for p in self.percentiles:
                out[f"p{percentile_key(p)}_{m}_ms"] = _stat(lambda x: np.percentile(x, p), v)
        lag = self.send_lag_ms
        for name, fn in (("median", np.median), ("p99", lambda x: np.percentile(x, 99)), ("max", np.max)):
            out[f"{name}_send_lag_ms"] = None if lag is None else _stat(fn, lag)
        if self.slo_ms:
            out["slo_ms"] = dict(self.slo_ms)
        out.update(self.settings)
        return out


def _stat(fn: Any, v: np.ndarray) -> float:
    # vLLM computes np.mean(x or 0): an empty sample gives 0.0, not NaN (JSON-safe).
    return float(fn(v)) if v.size else 0.0


def summarize(plan: Sequence[PlannedRequest], outcomes: Sequence[Outcome], *, percentiles: Sequence[float] = (90, 99),
              slo_ms: dict[str, float] | None = None, settings: dict[str, Any] | None = None,
              start_ns: int | None = None) -> BenchSummary:
    """Metrics over ``outcomes`` (one per sent request; ``plan`` gives planned prompt lengths and
    offsets). ``start_ns``: the run's start (``BenchRun.start_ns``), for the send lag."""
    by_index = {r.index: r for r in plan}
    ttft, tpot, itl, e2el = [], [], [], []
    inputs = outputs = good = 0
    failures = Counter(o.failure.label for o in outcomes if o.failure is not None)
    slo = slo_ms or {}
    for o in outcomes:
        if not o.ok or not o.recv_ns:  # the client marks a clean stream without tokens as malformed
            continue
        n_out = o.num_output_tokens if o.num_output_tokens >= 0 else len(o.recv_ns)
        n_in = o.num_prompt_tokens if o.num_prompt_tokens >= 0 else by_index[o.index].text.num_prompt_tokens
        inputs, outputs = inputs + n_in, outputs + n_out
        t_first = (o.recv_ns[0] - o.send_ns) / 1e6
        t_e2e = (o.finish_ns - o.send_ns) / 1e6
        t_pot = (t_e2e - t_first) / (n_out - 1) if n_out > 1 else 0.0
        ttft.append(t_first)
        e2el.append(t_e2e)
        if n_out > 1:
            tpot.append(t_pot)
        itl.extend(np.diff(np.asarray(o.recv_ns, dtype=np.int64)) / 1e6)
        values = {"ttft": t_first, "tpot": t_pot, "e2el": t_e2e}
        good += all(values[k] <= v for k, v in slo.items())
    completed = sum(1 for o in outcomes if o.ok and o.recv_ns)
    starts = [o.send_ns for o in outcomes]
    ends = [o.finish_ns for o in outcomes]
    duration = (max(ends) - min(starts)) / 1e9 if outcomes else 0.0
    return BenchSummary(
        num_sent=len(outcomes), num_planned=len(plan), completed=completed,
        failures={k.label: failures.get(k.label, 0) for k in FailureKind},
        num_cancelled=sum(1 for o in outcomes if o.cancelled), duration_s=duration,
        total_input_tokens=inputs, total_output_tokens=outputs,
        samples_ms={k: np.asarray(v, dtype=float) for k, v in
                    (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el))},
        percentiles=tuple(percentiles), slo_ms=dict(slo), num_good=good if slo else 0,
        settings=dict(settings or {}),
        send_lag_ms=None if start_ns is None or start_ns < 0 else np.asarray(
            [(o.send_ns - start_ns - round(by_index[o.index].offset_s * 1e9)) / 1e6 for o in outcomes
             if not o.cancelled], dtype=float),
    )


def render_text(s: BenchSummary, *, header_lines: Sequence[str] = ()) -> str:
    """The human summary, laid out like ``vllm bench serve``'s."""
    d = s.as_dict()
    lines = [f"{' Serving Benchmark Result ':=^50}"]
    lines += [f"{h}" for h in header_lines]

    def row(label: str, value: Any, fmt: str = "{:<10.2f}") -> None:
        text = fmt.format(value) if isinstance(value, float) else f"{value:<10}"
        lines.append(f"{label:<40} {text}")

    row("Successful requests:", s.completed)
    row("Failed requests:", s.num_failed)
    for kind, n in s.failures.items():
        if n:
            row(f"  {kind}:", n)
    if s.num_cancelled:
        row("Cancelled at the duration bound:", s.num_cancelled)
    if s.num_planned > s.num_sent:
        row("Not sent (duration bound):", s.num_planned - s.num_sent)
    row("Benchmark duration (s):", s.duration_s)
    row("Total input tokens:", s.total_input_tokens)
    row("Total generated tokens:", s.total_output_tokens)
    row("Request throughput (req/s):", d["request_throughput"])
    if s.slo_ms:
        row("Request goodput (req/s):", d["request_goodput"])
    row("Output token throughput (tok/s):", d["output_throughput"])
    row("Total Token throughput (tok/s):", d["total_token_throughput"])
    for m in METRICS:
        title, short = _TITLES[m]
        lines.append(f"{title:-^50}")
        row(f"Mean {short} (ms):", d[f"mean_{m}_ms"])
        row(f"Median {short} (ms):", d[f"median_{m}_ms"])
        for p in s.percentiles:
            row(f"P{percentile_key(p)} {short} (ms):", d[f"p{percentile_key(p)}_{m}_ms"])
    if s.send_lag_ms is not None:
        lines.append(f"{'Send lag (sent - due by the schedule)':-^50}")
        row("Median send lag (ms):", d["median_send_lag_ms"])
        row("P99 send lag (ms):", d["p99_send_lag_ms"])
        row("Max send lag (ms):", d["max_send_lag_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)

