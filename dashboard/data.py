"""The dashboard's read side: validated run ids, cached analyzer results, per-request traces.

Every number the dashboard shows comes from :mod:`analyzers` through a
:class:`DataSource`. It

* validates run ids from URLs against ``tokentrace.store.list_runs(store)``: an id is only
  ever used after it was found among the store's own run folders, so no path
  taken from a request reaches the file system unchecked;
* calls analyses as ``RunAnalysis`` methods (``src.result(rid, RunAnalysis.latency)``), never by name,
  and caches their results in a small LRU keyed by (run id, data version,
  analysis, its arguments); the data version is a fingerprint of the
  run's finished files, so in live mode new files invalidate the cache and in
  static mode it is computed once per run;
* serialises analyzer calls per run (an ``analyzers.analysis.RunAnalysis`` holds a
  DuckDB connection, which is not thread-safe);
* derives a finished run's shared facts once, before its first analysis, and keeps
  them next to the run (``<run>/_derived``, :mod:`analyzers.derivation`), so a view
  nobody has computed yet, in this process or a later one, starts from them.

Thread-safety: every public method may be called from any server thread; they
block while an analyzer computes. Bad input raises ``StoreError`` (a
``ValueError``) with one sentence; the pages show that sentence.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Hashable, TypeVar

import numpy as np
import pandas as pd

from analyzers.analysis import RunAnalysis
from tokentrace.app.analysis import Run
from tokentrace.app.report.render_names import instance_labels
from tokentrace.clock import latest_instances
from tokentrace.schema import INSTANCES, REQUESTS, SPANS, TOKENS, col
from tokentrace.store import RunInfo, StoreError, list_runs
from tokentrace.store.reader import find_run_dirs

__all__ = ["DataSource", "RequestTrace", "downsample", "series_window_s", "warm_calls", "MAX_POINTS",
           "MAX_LISTED_REQUESTS"]

T = TypeVar("T")
MAX_POINTS = 2000  # points per drawn series; longer series are downsampled
MAX_LISTED_REQUESTS = 10_000
"""The request explorer lists (filters, sorts, pages) the slowest this many requests of a run."""
_WINDOWS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 1800, 3600)  # time-series window ladder, s
_NUM_WINDOWS = 120  # about this many windows over a run
_RUN_LIST_TTL_S = {True: 2.0, False: 5.0}  # live, static: how long a listing of runs is trusted
# (runs added to the store later are found in both modes; a finished run's files are fingerprinted once in static mode)
_MAX_REQUEST_ID_CHARS = 20  # a 63-bit integer in decimal


@dataclass(frozen=True, slots=True)
class RequestTrace:
    """One request's rows on the run's reference clock (ns), for the waterfall.

    ``spans``/``tokens``/``requests`` hold every instance's rows of the request;
    ``instances`` one row per traced process (id, role, name).
    """

    request_id: int
    spans: pd.DataFrame
    tokens: pd.DataFrame
    requests: pd.DataFrame
    instances: pd.DataFrame


class _Lru:
    """A thread-safe least-recently-used map of bounded size."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._data: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> tuple[bool, Any]:
        with self._lock:
            if key not in self._data:
                return False, None
            self._data.move_to_end(key)
            return True, self._data[key]

    def put(self, key: Hashable, value: Any) -> None:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            while len(self._data) > self._size:
                self._data.popitem(last=False)


class DataSource:
    """Cached, validated access to the runs of one store; see the module doc."""

    def __init__(self, store: str | os.PathLike[str], *, live: bool = False, cache_size: int = 256) -> None:
        self.store = Path(store)
        self.live = live
        self._results = _Lru(cache_size)
        self._analyses = _Lru(8)  # (run id, version) -> RunAnalysis
        self._run_locks: dict[str, threading.RLock] = {}
        self._locks_lock = threading.Lock()
        self._listing: tuple[float, tuple[str, ...], list[RunInfo]] | None = None
        self._static_versions: dict[str, Hashable] = {}

    # ------------------------------------------------------------------ runs

    def runs(self) -> list[RunInfo]:
        """Every run of the store, oldest first (briefly cached). ``StoreError`` if not a usable store."""
        now = time.monotonic()
        listing = self._listing
        if listing is not None and now - listing[0] < _RUN_LIST_TTL_S[self.live]:
            return listing[2]
        if listing is not None and not self.live:  # a finished run does not change: list again only for a new one
            folders = tuple(p.name for p in find_run_dirs(self.store))
            if folders == listing[1]:
                self._listing = (now, folders, listing[2])
                return listing[2]
        infos = list_runs(self.store)
        self._listing = (now, tuple(Path(i.path).name for i in infos), infos)
        return infos

    def resolve(self, run_id: str | None) -> str:
        """``run_id`` if it is a run of this store, the newest run's id for ``None``; else ``StoreError``."""
        infos = self.runs()
        if run_id is None or run_id == "":
            return infos[-1].run_id
        known = {info.run_id for info in infos}
        if run_id not in known:
            self._listing = None  # a run may have appeared since the listing; look once more
            known = {info.run_id for info in self.runs()}
        if run_id not in known:
            raise StoreError(f"run {run_id[:80]!r} is not a run of this store")
        return run_id

    def info(self, run_id: str) -> RunInfo:
        """The :class:`RunInfo` of a validated run id."""
        rid = self.resolve(run_id)
        return next(i for i in self.runs() if i.run_id == rid)

    def open(self, run_id: str | None) -> Run:
        """The run, opened by its validated id (the path comes from the store's own listing)."""
        rid = self.resolve(run_id)
        path = next(i.path for i in self.runs() if i.run_id == rid)
        return Run(path)

    def version(self, run_id: str) -> Hashable:
        """The run's fingerprint (``Run.fingerprint``: its finished part files). Fixed once in static mode."""
        if not self.live and run_id in self._static_versions:
            return self._static_versions[run_id]
        fingerprint = self.open(run_id).fingerprint()
        if not self.live:
            self._static_versions[run_id] = fingerprint
        return fingerprint

    # --------------------------------------------------------------- results

    def _run_lock(self, run_id: str) -> threading.RLock:
        with self._locks_lock:
            return self._run_locks.setdefault(run_id, threading.RLock())  # re-entrant: a computation may use other cached results

    def _analysis(self, run_id: str, version: Hashable) -> Any:
        found, analysis = self._analyses.get((run_id, version))
        if not found:
            run = self.open(run_id)
            self._may_derive(run)
            analysis = run.analyze()
            self._analyses.put((run_id, version), analysis)
        return analysis

    def _may_derive(self, run: Run) -> None:
        """Derive a finished run's shared facts once and keep them next to it (``analyzers.derivation``), so that
        every later view, in this process or the next, reads them instead of deriving them again. A run still
        being written (live) is analyzed from its part files only. Best effort: a read-only store, or a run a
        writer reopened meanwhile, is analyzed through the part files as before."""
        from analyzers.derivation import derive

        try:
            if run.is_finished():
                derive(run)
        except Exception:  # noqa: BLE001 - the derived facts are a cache; the part files remain the answer
            pass

    def cached(self, run_id: str, key: Hashable, compute: Callable[[], T]) -> T:
        """``compute()`` once per (run, data version, key), then from the cache. Blocks while computing."""
        rid = self.resolve(run_id)
        full_key = (rid, self.version(rid), key)
        found, value = self._results.get(full_key)
        if found:
            return value
        with self._run_lock(rid):  # one computation per run at a time; a waiting caller finds it done
            found, value = self._results.get(full_key)
            if not found:
                value = compute()
                self._results.put(full_key, value)
        return value

    def result(self, run_id: str, analysis: Callable[..., T], **kwargs: Hashable) -> T:
        """``analysis(RunAnalysis of the run, **kwargs)``, cached (see :meth:`cached`). ``analysis`` is a
        ``RunAnalysis`` method, called through its class: ``src.result(rid, RunAnalysis.latency, by="tenant")``,
        ``src.result(rid, RunAnalysis.capacity_cdf)``, so a misspelt analysis fails where it is written."""
        if not callable(analysis):
            raise TypeError(f"an analysis is a RunAnalysis method (RunAnalysis.latency), got {analysis!r}")
        rid = self.resolve(run_id)
        key = (analysis.__qualname__, tuple(sorted(kwargs.items())))

        def compute() -> T:
            return analysis(self._analysis(rid, self.version(rid)), **kwargs)

        return self.cached(rid, key, compute)

    def instance_names(self, run_id: str) -> dict[int, str]:
        """Instance id -> the name a person reads (``prefill-0``), for every traced process of the run."""
        rid = self.resolve(run_id)

        def compute() -> dict[int, str]:
            return instance_labels(latest_instances(self.open(rid).table(INSTANCES.name)))

        return self.cached(rid, "instance_names", compute)

    def compare(self, candidate: str, baseline: str) -> pd.DataFrame:
        """Two validated runs compared (candidate against baseline, ``RunAnalysis.compare``: one run a side, judged
        against the documented run-to-run noise), cached."""
        cand, base = self.resolve(candidate), self.resolve(baseline)
        base_version = self.version(base)

        def compute() -> pd.DataFrame:
            base_analysis = self._analysis(base, base_version)
            return self._analysis(cand, self.version(cand)).compare([base_analysis])

        return self.cached(cand, ("compare", base, base_version), compute)

    def warm(self, run_id: str | None, calls: list[tuple[Callable[..., Any], dict[str, Hashable]]] | None = None
             ) -> threading.Thread:
        """Compute ``calls`` (analysis, kwargs; default :func:`warm_calls`) for a run in a daemon thread.

        So that the first view of a run does not wait for its analyzers. Errors are left for the pages to show.
        """
        rid = self.resolve(run_id)
        calls = warm_calls(self.info(rid)) if calls is None else calls

        def work() -> None:
            for analysis, kwargs in calls:
                try:
                    self.result(rid, analysis, **kwargs)
                except Exception:  # noqa: BLE001 - warming is best effort; the page will show the error
                    pass

        thread = threading.Thread(target=work, name=f"tokentrace-dashboard-warm-{rid}", daemon=True)
        thread.start()
        return thread

    # ------------------------------------------------------------- requests

    def request_page(self, run_id: str, *, tenant: str | None = None, slo_class: str | None = None,
                     sort: str | None = None, descending: bool = True, page: int = 0,
                     page_size: int = 20) -> tuple[pd.DataFrame, int]:
        """One page of the run's requests (analyzers' ``slowest_requests``), filtered and sorted here.

        Returns (rows of the page, number of pages). ``sort`` must be a column of
        the result (default: end-to-end latency); unknown names raise ``StoreError``.
        """
        rid = self.resolve(run_id)
        every = self.all_requests(rid)
        key = ("request_order", tenant, slo_class, sort, descending)
        return _page(self.cached(rid, key, lambda: _ordered(every, tenant, slo_class, sort, descending)),
                     page, page_size)

    def all_requests(self, run_id: str) -> pd.DataFrame:
        """The run's slowest ``MAX_LISTED_REQUESTS`` requests with latencies and stage times, slowest first."""
        rid = self.resolve(run_id)
        return self.result(rid, RunAnalysis.slowest_requests, n=MAX_LISTED_REQUESTS)

    def request_choices(self, run_id: str) -> dict[str, list[str]]:
        """The tenants and SLO classes the run's requests have (for the explorer's filters)."""
        rid = self.resolve(run_id)

        def compute() -> dict[str, list[str]]:
            every = self.all_requests(rid)
            return {c: sorted(str(v) for v in every[c].dropna().unique()) for c in (col.TENANT, col.SLO_CLASS)}

        return self.cached(rid, "request_choices", compute)

    def request_trace(self, run_id: str, request_id: str | int) -> RequestTrace:
        """Every row of one request, on the reference clock; ``StoreError`` if the id is malformed or unknown.

        Read through the analyzers' aligned DuckDB views of the run (filter pushed into the Parquet scan).
        """
        rid = self.resolve(run_id)
        req = _parse_request_id(request_id)

        def compute() -> RequestTrace:
            source = self._analysis(rid, self.version(rid)).source
            frames = {t: source.df(f"SELECT * FROM {t} WHERE {col.REQUEST_ID} = ?", [req])
                      for t in (SPANS.name, TOKENS.name, REQUESTS.name)}
            if frames[REQUESTS.name].empty and frames[SPANS.name].empty:
                raise StoreError(f"request {req} is not in run {rid}")
            run = self.open(rid)
            inst = latest_instances(run.table(INSTANCES.name)).select([col.INSTANCE_ID, col.ROLE, col.NAME])
            return RequestTrace(req, frames[SPANS.name], frames[TOKENS.name], frames[REQUESTS.name], inst.to_pandas())

        return self.cached(rid, ("request_trace", req), compute)


def _parse_request_id(value: str | int) -> int:
    text = str(value).strip()
    if not text.isdigit() or len(text) > _MAX_REQUEST_ID_CHARS:
        raise StoreError(f"request id {text[:40]!r} is not a request id (a non-negative integer)")
    return int(text)


def series_window_s(duration_ns: int) -> int:
    """Time-series window for a run: the smallest of a fixed ladder giving at most about 120 windows.

    A fixed ladder (rather than duration / 120) keeps the analyzer call, and so
    its cache key, the same while a live run grows.
    """
    wanted = duration_ns / 1e9 / _NUM_WINDOWS
    return next((w for w in _WINDOWS_S if w >= wanted), _WINDOWS_S[-1])


def warm_calls(info: RunInfo) -> list[tuple[Callable[..., Any], dict[str, Hashable]]]:
    """The analyses the views ask of a run by default (what warming computes ahead), the Overview's first."""
    w = series_window_s(info.duration_ns)
    a = RunAnalysis
    return [
        (a.diagnosis, {}), (a.load, {}), (a.latency, {}), (a.latency, {"window_s": w}), (a.slo, {}), (a.goodput, {}),
        (a.pd_ratio, {}),
        (a.capacity_throughput_summary, {}), (a.capacity_percentiles, {}), (a.capacity_offered_load, {}),
        (a.capacity_slo_targets, {}), (a.capacity_throughput, {"window_s": w}),
        (a.capacity_load_latency, {"window_s": w}), (a.queues, {"bucket_s": float(w)}), (a.capacity_cdf, {}),
        (a.capacity_ttft_by_prompt, {}),
        (a.attribution, {}), (a.stage_breakdown, {"by": None}), (a.critical_path, {}),
        (a.slowest_requests, {"n": MAX_LISTED_REQUESTS}),
        (a.queues, {}), (a.cache, {}), (a.batch, {}), (a.interference, {}), (a.speculation, {}), (a.sessions, {}),
        (a.tenants, {}), (a.noisy_neighbours, {}),
        (a.stage_breakdown, {"by": "tenant"}), (a.stage_breakdown, {"by": "slo_class"}),
    ]


def _ordered(every: pd.DataFrame, tenant: str | None, slo_class: str | None, sort: str | None,
             descending: bool) -> pd.DataFrame:
    rows = every
    if tenant:
        rows = rows[rows[col.TENANT] == tenant]
    if slo_class:
        rows = rows[rows[col.SLO_CLASS] == slo_class]
    if sort is not None and sort not in rows.columns:
        raise StoreError(f"cannot sort requests by {sort[:40]!r}: not a column of the request table")
    if sort is not None:
        rows = rows.sort_values(sort, ascending=not descending, kind="stable")
    return rows.reset_index(drop=True)


def _page(rows: pd.DataFrame, page: int, page_size: int) -> tuple[pd.DataFrame, int]:
    num_pages = max(1, -(-len(rows) // page_size))
    page = min(max(page, 0), num_pages - 1)
    return rows.iloc[page * page_size:(page + 1) * page_size], num_pages


def downsample(frame: pd.DataFrame, x: str, *, max_points: int = MAX_POINTS) -> pd.DataFrame:
    """At most about ``max_points`` rows of ``frame`` ordered by ``x``, for drawing.

    Keeps, in each of ``max_points // 2`` equal runs of rows, the rows holding
    the minimum and the maximum of every numeric column (so spikes survive);
    a frame that is already short is returned as is.
    """
    if len(frame) <= max_points:
        return frame
    ordered = frame.sort_values(x, kind="stable").reset_index(drop=True)
    numeric = [c for c in ordered.columns if c != x and pd.api.types.is_numeric_dtype(ordered[c])]
    num_buckets = max(1, max_points // (2 * max(1, len(numeric))))  # each keeps a min and a max per column
    buckets = np.arange(len(ordered)) * num_buckets // len(ordered)
    keep = {0, len(ordered) - 1}
    grouped = ordered.groupby(buckets)
    for c in numeric:
        keep.update(grouped[c].idxmin().dropna().astype(int).tolist())
        keep.update(grouped[c].idxmax().dropna().astype(int).tolist())
    return ordered.loc[sorted(keep)].reset_index(drop=True)
