"""Budgets: limits on a run's metrics that gate CI (``tokentrace report --budget FILE``).

A budget file is TOML, in either (or both) of two forms::

    [budgets]
    "ttft.p99" = "<= 800ms"
    "stage.schedule.queue.share_of_ttft" = "<= 0.3"
    "regression.itl.p99" = "<= +5%"

    budgets = ["ttft.p99 <= 800ms", "slo.interactive.attainment >= 90%"]

A limit is an operator (``<=``, ``<``, ``>=``, ``>``) and a number with a unit:

* time metrics (``ttft.p99``) need a time unit: ``ns``, ``us`` (or ``µs``), ``ms``, ``s``;
* ratio metrics (shares, attainment) take a plain fraction (``0.3``) or a percentage (``30%``);
* ``regression.<metric>`` compares the run with a baseline run: a percentage or a plain
  fraction is the relative change ``(run - baseline) / baseline`` (``+5%`` = 0.05); a time
  unit is the absolute change of a time metric (``<= +10ms``). It needs ``--baseline``.

Metric names are checked when the file is read (:data:`METRIC_PATTERNS`); a file that
cannot be parsed, an unknown name, a bad unit or a bad limit raises :class:`BudgetError`
(a ``ValueError``) with one sentence naming the file and the entry.
"""

from __future__ import annotations

import enum
import math
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from tokentrace.schema import UNATTRIBUTED_LABEL, Stage

__all__ = [
    "BudgetError",
    "MetricKind",
    "Budget",
    "BudgetResult",
    "LATENCY_METRICS",
    "LATENCY_STATS",
    "STAGE_STATS",
    "METRIC_PATTERNS",
    "REGRESSION_PREFIX",
    "metric_kind",
    "parse_budget",
    "parse_budgets",
    "load_budgets",
    "Change",
    "evaluate",
    "format_value",
]

LATENCY_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2e")
LATENCY_STATS: tuple[str, ...] = ("mean", "p50", "p90", "p99", "p99.9")
STAGE_STATS: tuple[str, ...] = ("share_of_ttft", "share_of_itl", "tail_share_of_ttft", "tail_share_of_itl")
SLO_STATS: tuple[str, ...] = ("attainment", "fluidity")
SPEC_RATIOS: tuple[str, ...] = ("acceptance_rate", "draft_share_of_decode", "rejected_draft_share")
SPEC_TIMES: tuple[str, ...] = ("ms_per_token", "mean_itl")
"""``spec.<name>``: speculative decoding's ratios (fractions) and times (ms) a budget may name."""
SESSION_KINDS: dict[str, str] = {"reuse_fraction": "ratio", "lost_tokens": "count", "extra_prefill": "time",
                                 "load": "time", "ttft_sum.mean": "time", "ttft_sum.p90": "time", "think.mean": "time"}
"""``session.<name>``: multi-turn sessions' metrics (:mod:`tokentrace.app.report.sessions`) and their kinds."""
REGRESSION_PREFIX = "regression."

METRIC_PATTERNS: tuple[str, ...] = (
    f"{{{','.join(LATENCY_METRICS)}}}.{{{','.join(LATENCY_STATS)}}}",
    f"stage.<stage>.{{{','.join(STAGE_STATS)}}}",
    "unattributed.share",
    "overlap.share",
    f"slo.<class>.{{{','.join(SLO_STATS)}}}",
    "goodput.rps",
    f"spec.{{{','.join(SPEC_RATIOS + SPEC_TIMES)}}}",
    f"session.{{{','.join(SESSION_KINDS)}}}",
    "counters.<name>",
    "regression.<any of the above>",
)
"""The metric names a budget may use, for error messages and docs."""

_OPS = ("<=", ">=", "<", ">")
_LIMIT_RE = re.compile(r"^\s*(<=|>=|<|>)\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*(ns|us|µs|ms|s|%)?\s*$")
_TIME_UNITS_MS = {"ns": 1e-6, "us": 1e-3, "µs": 1e-3, "ms": 1.0, "s": 1e3}
_LINE_RE = re.compile(r"^\s*([A-Za-z0-9_.\-]+)\s*((?:<=|>=|<|>).*)$")


class BudgetError(ValueError):
    """A budget file or entry that cannot be used; the message is one sentence."""


class MetricKind(enum.Enum):
    """What a metric's number means; fixes the units its limit may use."""

    TIME = "time"  # milliseconds
    RATIO = "ratio"  # a fraction 0..1
    RATE = "rate"  # requests per second
    COUNT = "count"  # events
    RELATIVE = "relative"  # (run - baseline) / baseline
    DELTA_TIME = "delta_time"  # run - baseline, milliseconds


@dataclass(frozen=True, slots=True)
class Budget:
    """One limit: ``metric op limit``, the limit in the kind's canonical unit (ms, fraction)."""

    metric: str
    op: str
    limit: float
    kind: MetricKind
    text: str  # the entry as written, e.g. "ttft.p99 <= 800ms"

    @property
    def is_regression(self) -> bool:
        return self.metric.startswith(REGRESSION_PREFIX)

    @property
    def base_metric(self) -> str:
        """The run metric the budget reads (``itl.p99`` for ``regression.itl.p99``)."""
        return self.metric[len(REGRESSION_PREFIX):] if self.is_regression else self.metric

    def holds(self, actual: float) -> bool:
        """Whether ``actual`` (canonical unit) is within the limit; NaN never is."""
        if math.isnan(actual):
            return False
        return {"<=": actual <= self.limit, "<": actual < self.limit,
                ">=": actual >= self.limit, ">": actual > self.limit}[self.op]


@dataclass(frozen=True, slots=True)
class BudgetResult:
    """A budget checked against a run: the measured value (canonical unit) and the verdict."""

    budget: Budget
    actual: float  # NaN when the metric could not be measured
    passed: bool
    message: str  # one sentence: "ttft.p99 = 912.0 ms, limit <= 800.0 ms"
    baseline: float | None = None  # the baseline's value of the base metric, for regressions


def metric_kind(name: str) -> MetricKind:
    """The kind of a (non-regression) metric name; ``BudgetError`` if it is not one."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[0] in LATENCY_METRICS and ".".join(parts[1:]) in LATENCY_STATS:
        return MetricKind.TIME
    if name in ("unattributed.share", "overlap.share"):
        return MetricKind.RATIO
    if name == "goodput.rps":
        return MetricKind.RATE
    if parts[0] == "spec" and len(parts) == 2 and parts[1] in SPEC_RATIOS + SPEC_TIMES:
        return MetricKind.RATIO if parts[1] in SPEC_RATIOS else MetricKind.TIME
    if parts[0] == "session" and ".".join(parts[1:]) in SESSION_KINDS:
        return {"ratio": MetricKind.RATIO, "count": MetricKind.COUNT,
                "time": MetricKind.TIME}[SESSION_KINDS[".".join(parts[1:])]]
    if parts[0] == "counters" and len(parts) == 2 and parts[1]:
        return MetricKind.COUNT
    if parts[0] == "slo" and len(parts) >= 3 and parts[-1] in SLO_STATS:
        return MetricKind.RATIO
    if parts[0] == "stage" and len(parts) >= 3 and parts[-1] in STAGE_STATS:
        stage = ".".join(parts[1:-1])
        valid = [s.label for s in Stage] + [UNATTRIBUTED_LABEL]
        if stage not in valid:
            raise BudgetError(f"unknown stage {stage!r} in metric {name!r}; stages: {', '.join(valid)}")
        return MetricKind.RATIO
    raise BudgetError(f"unknown metric {name!r}; valid metrics: {'; '.join(METRIC_PATTERNS)}")


def _kind_and_limit(metric: str, number: float, unit: str | None, entry: str) -> tuple[MetricKind, float]:
    regression = metric.startswith(REGRESSION_PREFIX)
    kind = metric_kind(metric[len(REGRESSION_PREFIX):] if regression else metric)
    if unit in _TIME_UNITS_MS:
        if kind is not MetricKind.TIME:
            raise BudgetError(f"budget {entry!r}: a time unit ({unit}) only fits a time metric such as ttft.p99")
        return (MetricKind.DELTA_TIME if regression else MetricKind.TIME), number * _TIME_UNITS_MS[unit]
    value = number / 100 if unit == "%" else number
    if regression:
        return MetricKind.RELATIVE, value
    if kind is MetricKind.TIME:
        raise BudgetError(f"budget {entry!r}: a time metric needs a unit (ns, us, ms or s), e.g. <= 800ms")
    if unit == "%" and kind is not MetricKind.RATIO:
        raise BudgetError(f"budget {entry!r}: a percentage only fits a ratio metric (shares, attainment)")
    return kind, value


def parse_budget(metric: str, limit: str, *, source: str = "budget") -> Budget:
    """One budget from a metric name and a limit such as ``"<= 800ms"``; ``BudgetError`` if invalid."""
    metric = metric.strip()
    entry = f"{metric} {limit.strip()}" if isinstance(limit, str) else f"{metric} {limit!r}"
    if not isinstance(limit, str):
        raise BudgetError(f"{source}: the limit of {metric!r} must be a string such as \"<= 800ms\", got {limit!r}")
    m = _LIMIT_RE.match(limit)
    if m is None:
        raise BudgetError(f"{source}: cannot read limit {limit!r} of {metric!r}; write an operator "
                          f"({', '.join(_OPS)}) and a number with a unit, e.g. \"<= 800ms\", \"<= 0.3\", \"<= +5%\"")
    op, number, unit = m.group(1), float(m.group(2)), m.group(3)
    try:
        kind, value = _kind_and_limit(metric, number, unit, entry)
        _check_range(kind, value, entry)
    except BudgetError as err:
        raise BudgetError(f"{source}: {err}") from None
    return Budget(metric=metric, op=op, limit=value, kind=kind, text=entry)


def _check_range(kind: MetricKind, value: float, entry: str) -> None:
    """A limit the metric can reach: finite, and within the kind's range (times, rates and
    counts are not negative, shares lie in 0..1, a relative change is not below -100%)."""
    if not math.isfinite(value):
        raise BudgetError(f"budget {entry!r}: the limit must be a finite number")
    if kind in (MetricKind.TIME, MetricKind.RATE, MetricKind.COUNT) and value < 0:
        raise BudgetError(f"budget {entry!r}: a {kind.value} limit cannot be negative")
    if kind is MetricKind.RATIO and not 0 <= value <= 1:
        raise BudgetError(f"budget {entry!r}: a share or attainment lies between 0 and 1 (0% and 100%)")
    if kind is MetricKind.RELATIVE and value < -1:
        raise BudgetError(f"budget {entry!r}: a relative change cannot be below -100%")


def _parse_line(line: Any, source: str) -> Budget:
    if not isinstance(line, str):
        raise BudgetError(f"{source}: each entry of the budgets list must be a string such as "
                          f"\"ttft.p99 <= 800ms\", got {line!r}")
    m = _LINE_RE.match(line)
    if m is None:
        raise BudgetError(f"{source}: cannot read budget {line!r}; write it as \"<metric> <op> <limit>\", "
                          f"e.g. \"ttft.p99 <= 800ms\"")
    return parse_budget(m.group(1), m.group(2), source=source)


def parse_budgets(data: Mapping[str, Any], *, source: str = "budget file") -> tuple[Budget, ...]:
    """Budgets from a parsed TOML document: a ``[budgets]`` table and/or a ``budgets`` list.

    Raises ``BudgetError`` if neither is present, either has the wrong type, or
    any entry is invalid. Order: the file's order; a metric may appear more than once.
    """
    section = data.get("budgets")
    if section is None:
        raise BudgetError(f"{source} has no budgets: add a [budgets] table or a budgets = [...] list")
    if isinstance(section, Mapping):
        out = []
        for metric, limit in section.items():
            if isinstance(limit, Mapping):
                raise BudgetError(f"{source}: quote dotted metric names in [budgets], e.g. \"{metric}.p99\" = "
                                  f"\"<= 800ms\" (TOML read {metric!r} as a table)")
            out.append(parse_budget(metric, limit, source=source))
        return tuple(out)
    if isinstance(section, list):
        return tuple(_parse_line(line, source) for line in section)
    raise BudgetError(f"{source}: budgets must be a table or a list of strings, got {type(section).__name__}")


def load_budgets(path: str | os.PathLike[str]) -> tuple[Budget, ...]:
    """Read and parse a TOML budget file; ``BudgetError`` for a missing, unreadable or malformed file."""
    p = Path(path)
    if not p.is_file():
        raise BudgetError(f"budget file {p} does not exist or is not a file")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise BudgetError(f"budget file {p} is not UTF-8 text") from None
    except tomllib.TOMLDecodeError as err:
        raise BudgetError(f"budget file {p} is not valid TOML: {err}") from None
    return parse_budgets(data, source=f"budget file {p}")


def format_value(value: float, kind: MetricKind) -> str:
    """A value in a kind's canonical unit as text: ``812.4 ms``, ``0.312``, ``+7.3%``, ``12``."""
    if value is None or math.isnan(value):
        return "not measured"
    if kind in (MetricKind.TIME, MetricKind.DELTA_TIME):
        sign = "+" if kind is MetricKind.DELTA_TIME and value >= 0 else ""
        return f"{sign}{value:.3f} ms" if abs(value) < 10 else f"{sign}{value:.1f} ms"
    if kind is MetricKind.RELATIVE:
        return f"{value * 100:+.1f}%" if math.isfinite(value) else ("+inf%" if value > 0 else "-inf%")
    if kind is MetricKind.RATE:
        return f"{value:.3f} req/s"
    if kind is MetricKind.COUNT:
        return f"{value:,.0f}"
    return f"{value:.4f}"


def _relative(actual: float, base: float) -> float:
    if math.isnan(actual) or math.isnan(base):
        return math.nan
    if base == 0:
        return 0.0 if actual == 0 else math.copysign(math.inf, actual)
    return (actual - base) / abs(base)


@dataclass(frozen=True, slots=True)
class Change:
    """A metric in the baseline and in the run; ``significant``: the change is real, not noise.

    For latency statistics it comes from the diff analyzer's bootstrap confidence
    interval of the difference (the interval excludes 0); for other metrics (shares,
    attainment, counters) it is True: they are compared as measured.
    """

    baseline: float
    candidate: float
    significant: bool = True


def _check_one(b: Budget, metrics: Mapping[str, float], changes: Mapping[str, Change] | None) -> BudgetResult:
    if not b.is_regression:
        actual = float(metrics.get(b.metric, math.nan))
        passed = b.holds(actual)
        if math.isnan(actual):
            return BudgetResult(b, actual, False, f"{b.metric} was not measured in this run (no samples), "
                                                   f"limit {b.op} {format_value(b.limit, b.kind)}")
        verdict = "within" if passed else "violates"
        return BudgetResult(b, actual, passed, f"{b.metric} = {format_value(actual, b.kind)} {verdict} "
                                               f"limit {b.op} {format_value(b.limit, b.kind)}")
    if changes is None:
        raise BudgetError(f"budget {b.text!r} compares with a baseline run: pass --baseline STORE[:RUN]")
    change = changes.get(b.base_metric, Change(math.nan, math.nan))
    if b.kind is MetricKind.DELTA_TIME:
        actual = change.candidate - change.baseline
    else:
        actual = _relative(change.candidate, change.baseline)
    limit = f"{b.op} {format_value(b.limit, b.kind)}"
    if math.isnan(actual):
        return BudgetResult(b, actual, False, f"{b.metric} was not measured in the run or the baseline, limit {limit}",
                            change.baseline)
    kind = metric_kind(b.base_metric)
    values = f"(run {format_value(change.candidate, kind)}, baseline {format_value(change.baseline, kind)})"
    if b.holds(actual):
        return BudgetResult(b, actual, True, f"{b.metric} = {format_value(actual, b.kind)} within limit {limit} "
                                             f"{values}", change.baseline)
    if not change.significant:
        return BudgetResult(b, actual, True, f"{b.metric} = {format_value(actual, b.kind)} is past limit {limit} "
                                             f"{values} but not significant (the confidence interval includes 0)",
                            change.baseline)
    return BudgetResult(b, actual, False, f"{b.metric} = {format_value(actual, b.kind)} violates limit {limit} "
                                          f"{values}", change.baseline)


def evaluate(budgets: tuple[Budget, ...] | list[Budget], metrics: Mapping[str, float],
             changes: Mapping[str, Change] | None = None) -> tuple[BudgetResult, ...]:
    """Check each budget against the run's ``metrics`` (and ``changes`` vs a baseline).

    A metric missing from ``metrics`` or NaN fails its budget ("not measured"):
    a gate must not pass on data it does not have. A regression budget fails only
    when its change is past the limit *and* significant. Raises ``BudgetError`` if
    a regression budget is given without ``changes`` (no baseline run).
    """
    return tuple(_check_one(b, metrics, changes) for b in budgets)
