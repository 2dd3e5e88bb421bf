"""``RunAnalysis``: every analysis of one run, behind one object with the user documentation.

Open it from a store::

    run = tokentrace.open("traces/")           # the newest run
    a = run.analyze()                          # a RunAnalysis
    a.load()                                   # offered vs served load; saturated? which pool?
    a.latency(by="tenant")                     # TTFT / TPOT / ITL / E2E percentiles per tenant
    a.stage_breakdown()                        # where TTFT and ITL went, mean and tail
    a.slo(); a.goodput(); a.fluidity()         # SLO attainment, DistServe goodput, Etalon fluidity
    a.speculation()                            # speculative decoding: acceptance, draft cost, where it hurt
    a.sessions()                               # multi-turn sessions: cross-turn KV reuse, what evictions cost
    a.diagnosis()                              # why: each missed request's causes, evidence and fix
    a.capacity_load_latency(window_s=10)       # capacity: throughput, percentiles, load against latency, CDFs
    a.diff(tokentrace.open("baseline/").analyze())
    a.compare([tokentrace.open("base/", r) for r in ("a", "b", "c")])  # tested against run-to-run noise

Each method delegates to one module of :mod:`analyzers` and returns pandas
DataFrames (or a small frozen dataclass of them); column meanings and formulas
are in ``docs/analyzers.md``. Nothing is printed, plotted or written.

The analyses run in DuckDB over the run's Parquet files (only result rows reach
memory), or on Apache Spark with ``run.analyze(engine="spark")`` (the same SQL,
translated; :mod:`analyzers.spark_engine`). A table the run lacks reads as empty, so its analyses return empty
frames. Results are not cached between calls except the per-token and
per-request facts every analysis shares. Not thread-safe: one ``RunAnalysis``
per thread.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import pandas as pd

from analyzers import attribution as _attribution
from analyzers import batch as _batch
from analyzers import cache as _cache
from analyzers import capacity as _capacity
from analyzers import compare as _compare
from analyzers import critical_path as _critical
from analyzers import diagnosis as _diagnosis
from analyzers import diff as _diff
from analyzers import latency as _latency
from analyzers import load as _load
from analyzers import loop_lag as _loop_lag
from analyzers import neighbours as _neighbours
from analyzers import pd_ratio as _pd
from analyzers import queues as _queues
from analyzers import sessions as _sessions
from analyzers import slo as _slo
from analyzers import speculative as _speculative
from analyzers import stage_breakdown as _breakdown
from analyzers import tenants as _tenants
from analyzers.source import Source

__all__ = ["RunAnalysis"]


class RunAnalysis:
    """The analyses of one run. Build with ``Run.analyze()`` or ``RunAnalysis(run)`` / ``RunAnalysis.of(source)``."""

    def __init__(self, run: Any = None, *, source: Source | None = None, engine: Any = None) -> None:
        if source is None:
            if run is None:
                raise ValueError("RunAnalysis needs a run (tokentrace.open(...)) or a source")
            source = Source.of_run(run, engine=engine)
        self.run = run
        self.source = source

    @classmethod
    def of(cls, source: Source) -> "RunAnalysis":
        """Analyses over an existing :class:`~analyzers.source.Source` (e.g. in-memory tables)."""
        return cls(source=source)

    # ------------------------------------------------------------ load

    def load(self) -> _load.LoadReport:
        """Offered load (over the arrival window) against served load, and whether the run was saturated:
        the verdict, the pool and the stage that saturate, per-pool utilisation and queue growth. Computed once per
        source (the diagnosis reads the same verdict)."""
        return _load.cached_load(self.source)

    # ------------------------------------------------------------ latency and SLOs

    def latency(self, *, by: str | None = None, window_s: float | None = None) -> pd.DataFrame:
        """TTFT, TPOT, ITL and E2E: count, mean, p50/p90/p99/p99.9 (ms), overall or per
        ``by`` in ``"tenant"``, ``"slo_class"``, ``"instance"``, or per arrival window of ``window_s``."""
        return _latency.latency(self.source, by=by, window_s=window_s)

    def slo(self, *, targets: Mapping[str, _slo.SloTargets] | None = None) -> pd.DataFrame:
        """Share of requests meeting their class's TTFT and TPOT targets, per class and overall (``*``)."""
        return _slo.slo_attainment(self.source, targets=targets)

    def goodput(self, *, targets: Mapping[str, _slo.SloTargets] | None = None, target_share: float = 0.9,
                window_s: float | None = None) -> pd.DataFrame:
        """DistServe goodput: good requests per second, and the highest load at which >= ``target_share`` met both SLOs."""
        return _slo.goodput(self.source, targets=targets, target_share=target_share, window_s=window_s)

    def fluidity(self, *, targets: Mapping[str, _slo.SloTargets] | None = None) -> pd.DataFrame:
        """Etalon fluidity-index (share of per-token deadlines met, with deadline reset after a miss)."""
        return _slo.fluidity(self.source, targets=targets)

    def diagnosis(self, *, ttft_ms: float | None = None, itl_ms: float | None = None, e2e_ms: float | None = None,
                  targets: Mapping[str, _slo.SloTargets] | None = None) -> _diagnosis.Diagnosis:
        """Why: for each request that missed a target (its class's TTFT / TPOT, the ITL target on every token gap,
        or the ``ttft_ms`` / ``itl_ms`` / ``e2e_ms`` given here), the causes of its time over target in ms, ordered,
        each with its evidence and fix; ``summary`` ranks the causes by the share of all missed time they explain
        (rules: ``docs/diagnosis.md``)."""
        return _diagnosis.diagnose(self.source, targets=_diagnosis.Targets(ttft_ms, itl_ms, e2e_ms),
                                   slo_targets=targets)

    # ------------------------------------------------------------ where the time went

    def stage_breakdown(self, *, by: str | None = None, window_s: float | None = None) -> pd.DataFrame:
        """Each stage's mean time and share of TTFT and ITL, over all tokens and over the slowest 1%;
        overall or per ``by`` / arrival window as :meth:`latency`."""
        return _breakdown.breakdown(self.source, by=by, window_s=window_s)

    def unattributed_share(self) -> float:
        """Token latency minus stage time, over all token latency, signed (negative when stages claim more
        than the tokens' time); |share| should stay under 0.01."""
        return _attribution.unattributed_share(self.source)

    def overlap_share(self) -> float:
        """Time two or more stages both claim (double-counted), over all token latency; should stay under 0.01."""
        return _attribution.overlap_share(self.source)

    def attribution(self) -> pd.DataFrame:
        """Unattributed (signed), overlap and uncovered shares for TTFT, ITL and all tokens."""
        return _attribution.attribution(self.source)

    def critical_path(self) -> pd.DataFrame:
        """Ordered stage chain to the first token, for median (p50) and tail (p99) requests."""
        return _critical.critical_path(self.source)

    def slowest_requests(self, n: int = 10) -> pd.DataFrame:
        """The ``n`` slowest requests (end-to-end) with their time per stage."""
        return _critical.slowest_requests(self.source, n)

    def loop_lag(self) -> _loop_lag.LoopLag:
        """How late each sampled event loop (the gateway's) ran, and the share of each stage's
        time that fell inside those late intervals."""
        return _loop_lag.loop_lag(self.source)

    # ------------------------------------------------------------ resources

    def queues(self, *, bucket_s: float = 1.0) -> _queues.Queues:
        """Queue lengths over time per instance, queueing-delay distribution, Little's-law check."""
        return _queues.queues(self.source, bucket_s=bucket_s)

    def littles_law(self) -> pd.DataFrame:
        """L measured from steps against lambda * W from requests, per engine instance."""
        return _queues.littles_law(self.source)

    def cache(self) -> _cache.CacheReport:
        """Prefix hit rates (by tokens and requests, over time, beside the best achievable), per-tier hits, churn,
        transfers, and the value of a hit on the stages it changes (lookup, load, prefill per prompt token)."""
        return _cache.cache(self.source)

    def pd_ratio(self, *, headroom: float = _pd.DEFAULT_HEADROOM,
                 targets: Mapping[str, _slo.SloTargets] | None = None) -> _pd.PdRatio:
        """Prefill / decode utilisation per pool, queue watermarks, KV transfer share, and whole instances per
        pool for the offered load within the SLO targets, keeping ``headroom`` of each instance idle."""
        return _pd.pd_ratio(self.source, targets=targets, headroom=headroom)

    # ------------------------------------------------------------ capacity

    def capacity_throughput(self, *, window_s: float) -> pd.DataFrame:
        """Requests and tokens per second per window of ``window_s`` (completions, input and output tokens)."""
        return _capacity.throughput(self.source, window_s=window_s)

    def capacity_throughput_summary(self) -> pd.DataFrame:
        """One row: requests, tokens, duration and the run's mean request and token rates."""
        return _capacity.throughput_summary(self.source)

    def capacity_offered_load(self) -> pd.DataFrame:
        """One row: the offered request rate over the arrival window (the load analysis's figure alone)."""
        return _capacity.offered_load(self.source)

    def capacity_slo_targets(self) -> pd.DataFrame:
        """The run's SLO targets per class, without judging a request."""
        return _capacity.slo_targets(self.source)

    def capacity_percentiles(self, *, levels: tuple[float, ...] = _capacity.CAPACITY_PERCENTILES) -> pd.DataFrame:
        """TTFT, TPOT, ITL and E2E at the capacity percentiles ``levels``."""
        return _capacity.percentiles(self.source, levels=levels)

    def capacity_load_latency(self, *, window_s: float,
                              percentiles: tuple[float, ...] = _capacity.CAPACITY_PERCENTILES) -> pd.DataFrame:
        """Per arrival window of ``window_s``: offered rate beside the latency percentiles of its requests."""
        return _capacity.load_latency(self.source, window_s=window_s, percentiles=percentiles)

    def capacity_cdf(self, *, points: int = 200) -> pd.DataFrame:
        """``points`` + 1 evenly spaced quantiles of each latency metric (its distribution function)."""
        return _capacity.cdf(self.source, points=points)

    def capacity_ttft_by_prompt(self, *, bins: int = 20,
                                percentiles: tuple[float, ...] = _capacity.CAPACITY_PERCENTILES) -> pd.DataFrame:
        """TTFT percentiles per prompt-length bin (about ``bins`` bins of equal size)."""
        return _capacity.ttft_by_prompt(self.source, bins=bins, percentiles=percentiles)

    def batch(self) -> pd.DataFrame:
        """Step time and ITL against batch size (power-of-two bins)."""
        return _batch.batch_profile(self.source)

    def interference(self, *, tail_fraction: float = 0.01) -> pd.DataFrame:
        """What shared the steps of the slowest decode tokens, against median tokens."""
        return _batch.interference(self.source, tail_fraction=tail_fraction)

    # ------------------------------------------------------------ speculative decoding

    def speculation(self, *, min_effect_ms: float = _speculative.MIN_EFFECT_MS,
                    min_tokens: int = _speculative.MIN_TOKENS) -> _speculative.SpecReport:
        """Speculative decoding: acceptance by draft position, request, tenant and batch size; accepted tokens per
        verify step; draft cost and rejected draft work; ITL of speculative against plain decode tokens (measured
        and amortized per token), and the batch sizes where speculation was slower. Empty frames without it."""
        return _speculative.speculation(self.source, min_effect_ms=min_effect_ms, min_tokens=min_tokens)

    def acceptance(self, *, by: str | None = None) -> pd.DataFrame:
        """Speculative acceptance rate, overall or per ``by`` in ``"request"``, ``"tenant"``, ``"batch_size"``,
        ``"draft_source"``."""
        return _speculative.acceptance(self.source, by=by)

    # ------------------------------------------------------------ tenants

    def sessions(self) -> _sessions.SessionReport:
        """Multi-turn sessions: per turn and per session, TTFT, generation and think time; cross-turn prefix
        reuse (carried, reused per tier, lost tokens) and what the KV lost during think time cost (extra
        prefill, load time); the retention policy's record; tenant fairness per session and per request."""
        return _sessions.sessions(self.source)

    def tenants(self, *, weights: Mapping[str, float] | None = None) -> _tenants.TenantReport:
        """Per-tenant latency, shares and Jain's fairness by requests, tokens and compute time."""
        return _tenants.tenants(self.source, weights=weights)

    def noisy_neighbours(self, *, window_s: float | None = None, z_threshold: float = 2.0,
                         permutations: int = 1000, seed: int = 0) -> pd.DataFrame:
        """Every tenant pair: the victim's TTFT in the aggressor's arrival bursts against its own trend,
        with sample sizes and a permutation p-value; flagged only with enough data and a real effect."""
        return _neighbours.noisy_neighbours(self.source, window_s=window_s, z_threshold=z_threshold,
                                            permutations=permutations, seed=seed)

    # ------------------------------------------------------------ comparisons

    def diff(self, baseline: Any, *, resamples: int = 1000, seed: int = 0, min_effect: float = 0.02,
             min_effect_ms: float = 0.1, confidence: float = 0.95) -> pd.DataFrame:
        """This run (candidate) against ``baseline`` (a RunAnalysis, Run or Source): bootstrap CIs, p-values and
        sample sizes per metric and stage; significant changes need ``min_effect`` and ``min_effect_ms``;
        regressions ranked by their contribution to TTFT and ITL."""
        return _diff.diff(_as_source(baseline, self.source), self.source, resamples=resamples, seed=seed,
                          min_effect=min_effect, min_effect_ms=min_effect_ms, confidence=confidence)

    def compare(self, baselines: Sequence[Any], *, others: Sequence[Any] = (),
                noise: _compare.NoiseModel | None = None, confidence: float = 0.95, power: float = 0.9,
                min_effect: float = 0.02, min_effect_ms: float = 0.1) -> pd.DataFrame:
        """This run and ``others`` (the candidate runs) against ``baselines`` (RunAnalysis, Run or Source each),
        tested at the level of runs (``analyzers.compare``): a change counts only past what run-to-run noise
        produces (measured from the runs when a side has two or more, else ``noise``: A/A runs measured with
        :meth:`noise`, or the documented default); each row says the smallest change it could detect."""
        return _compare.compare([_as_source(b, self.source) for b in baselines],
                                [self.source] + [_as_source(o, self.source) for o in others], noise=noise,
                                confidence=confidence, power=power, min_effect=min_effect,
                                min_effect_ms=min_effect_ms)

    def noise(self, others: Sequence[Any], *, source: str) -> _compare.NoiseModel:
        """Run-to-run noise measured from this run and ``others``, runs of one configuration (A/A runs; at least
        three in all), for comparisons of single runs (:meth:`compare`); ``source`` says where they came from."""
        return _compare.measure_noise([self.source] + [_as_source(o, self.source) for o in others], source=source)

    def agreement(self) -> pd.DataFrame:
        """Server view against the client's (``analyzers.agreement.agreement_summary``); empty without client rows."""
        from analyzers import agreement

        return agreement.source_agreement_summary(self.source)


def _as_source(x: Any, like: Source) -> Source:
    """``x`` as a source; a run is opened on the engine of ``like``."""
    if isinstance(x, RunAnalysis):
        return x.source
    if isinstance(x, Source):
        return x
    if hasattr(x, "files") and hasattr(x, "table"):
        return Source.of_run(x, engine=like.engine.name)
    raise ValueError(f"baseline must be a RunAnalysis, a Run or a Source, got {type(x).__name__}")
