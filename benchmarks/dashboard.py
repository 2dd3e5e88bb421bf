"""Benchmark: first render of every dashboard view on a store of 1 M requests, in headless Chromium.

1. Writes a synthetic run ``bench`` (``tests/dashboard/synthetic_store.py``: every table of
   the schema, real store layout) of ``--requests`` requests with their tokens, spans,
   steps and cache events; 30% of its requests are turns of multi-turn sessions (session
   names and turns, the retention policy's carry, retain and drop events) and its engine
   speculates in about half of its time (``spec_steps`` rows, decode.draft and decode.verify
   spans), so the Sessions and Speculative views draw a whole run. Beside it, a run
   ``baseline`` a tenth of its size whose engine never speculates: what the Compare view
   (``/compare?run=bench&base=baseline``) diffs ``bench`` against.
2. Derives the runs' shared facts into ``<run>/_derived`` (``analyzers.derivation``:
   what the dashboard does before its first analysis of a finished run; timed and
   printed), builds the app and times, in-process, every analyzer call the views make
   (cold: DuckDB over the Parquet files and the derived facts, nothing cached) and the
   comparison of the two runs. This is what ``tokentrace dashboard`` does in the background at
   start (``warm``; the comparison is computed when Compare is first opened).
3. Serves the app on 127.0.0.1 and loads each view once in a fresh headless
   Chromium, timing from navigation until every graph is drawn (first render,
   results served from the server-side cache).
4. Cold: for each view, the app's data source is replaced by a new one (nothing
   cached: no analysis, no DuckDB connection, no run listing; the derived facts of
   step 2 stay on disk, as they do between two dashboard processes), then the view is
   loaded: the first render of a view nobody has computed yet, analyzer time
   included, as the first person to open that view after ``tokentrace dashboard``
   started would see it (without the start-up warming). One browser, so Dash's and
   Plotly's scripts come from its HTTP cache, as they do when moving between views.

Each view's render is checked: a view that drew no graph or showed an error is named
(``did not draw``), since its time would not be that of the view.

The last line is ``slowest_view_first_render_s=<s>``: the slowest view of step 3.
The line above it is ``slowest_view_cold_render_s=<s>``: the slowest view of step 4.
Target: 3 s per view, warm and cold.

Run: ``.venv/bin/python benchmarks/dashboard.py`` (about 5-10 minutes for 1 M
requests on 2 CPUs; ``--requests 100000`` for a quick look; ``--store DIR`` keeps
the generated store and reuses it next time).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "dashboard"))

from browser import graph_points, texts, visit  # noqa: E402
from synthetic_store import write_run  # noqa: E402

from analyzers.derivation import derive  # noqa: E402
from dashboard.app import create_app  # noqa: E402
from dashboard.components.shell import SOURCE_KEY  # noqa: E402
from dashboard.data import DataSource, warm_calls  # noqa: E402
from tokentrace.schema import col  # noqa: E402
from tokentrace.store.reader import open_run  # noqa: E402

VIEWS = ("/", "/capacity", "/breakdown", "/explorer", "/queues", "/cache", "/pd-ratio", "/batch", "/tenants",
         "/sessions", "/speculative", "/compare")
BASELINE = "baseline"  # the run /compare diffs the benchmark's run against
SESSION_SHARE = 0.3  # of the requests: turns of multi-turn sessions
TARGET_S = 3.0


def _chromium(profile: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
                 "--window-size=1400,1000"):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)


def _serve(app):
    import logging
    import threading

    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request in the output

    server = make_server("127.0.0.1", 0, app.server, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_port}"


def _browse(url: str, paths: list[str], work: Path, tag: str, *, fresh: bool,
            before_each: Callable[[], None] | None = None) -> dict[str, float]:
    """First render of each path: each in a fresh browser profile (``fresh``: nothing in the HTTP cache,
    so Dash's and Plotly's scripts are fetched and compiled every time) or one after the other in one
    browser, as a user moving between views (each a full page load; scripts from the HTTP cache).
    ``before_each`` runs before each path is loaded (step 4 empties the server's cache there)."""
    times = {}
    driver = None
    try:
        if before_each is not None:  # load the scripts once, so every timed view finds them in the HTTP cache
            driver = _chromium(tempfile.mkdtemp(prefix=f"tt-bench-{tag}-", dir=work))
            visit(driver, url + "/?run=-", timeout_s=900)  # a sentence: "not a run of this store"
        for i, path in enumerate(paths):
            if driver is None or fresh:
                if driver is not None:
                    driver.quit()
                driver = _chromium(tempfile.mkdtemp(prefix=f"tt-bench-{tag}-{i}-", dir=work))
            if before_each is not None:
                before_each()
            times[path] = visit(driver, url + path, timeout_s=900)
            problem = _not_drawn(driver)
            if problem:
                print(f"  {tag}: {path} did not draw ({problem}): its time is not that of the view")
    finally:
        if driver is not None:
            driver.quit()
    return times


def _not_drawn(driver) -> str:
    """What is wrong with the view just rendered ('' when it drew every graph and shows no error)."""
    errors = texts(driver, ".tt-error")
    if errors:
        return "error: " + errors[0][:120]
    points = graph_points(driver)
    if not points:
        return "no graph: " + " ".join(texts(driver, ".tt-notice"))[:120]
    empty = [g for g, n in points.items() if n <= 0]
    return f"empty graphs: {', '.join(empty)}" if empty else ""


def _show(title: str, times: dict[str, float]) -> None:
    print(title)
    for path, s in times.items():
        print(f"  {path:<60} {s:6.2f}{'   over the 3 s target' if s > TARGET_S else ''}")


def _time_analyzers(app, run_id: str) -> dict[str, float]:
    src = app.server.config[SOURCE_KEY]
    out = {}
    for analysis, kwargs in warm_calls(src.info(run_id)):
        t = time.perf_counter()
        src.result(run_id, analysis, **kwargs)
        out[f"{analysis.__name__}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"] = time.perf_counter() - t
    t = time.perf_counter()
    src.compare(run_id, BASELINE)  # what the Compare view shows
    out[f"compare(baseline={BASELINE})"] = time.perf_counter() - t
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1_000_000)
    ap.add_argument("--tokens", type=float, default=4.0, help="mean output tokens per request")
    ap.add_argument("--skip-cold", action="store_true", help="skip step 4 (views on an empty cache)")
    ap.add_argument("--store", type=Path, help="keep the generated store here and reuse it when it is already "
                                               "there (default: a temporary folder, removed at the end)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="tt-bench-dashboard-"))
    store = args.store or work / "store"
    try:
        t = time.perf_counter()
        if (store / "bench").is_dir() and (store / BASELINE).is_dir():
            print(f"reusing the store at {store}")
        elif (store / "bench").is_dir():
            raise SystemExit(f"{store} holds a run 'bench' of an older version of this benchmark (without sessions, "
                             f"speculation or a run to compare with): remove it or name another --store")
        else:
            write_run(store, BASELINE, num_requests=max(1, args.requests // 10), mean_output_tokens=args.tokens,
                      rate_rps=500.0, seed=1, sessions=SESSION_SHARE)
            write_run(store, "bench", num_requests=args.requests, mean_output_tokens=args.tokens, rate_rps=500.0,
                      sessions=SESSION_SHARE, speculative=True)
        gen_s = time.perf_counter() - t
        info = DataSource(store).info("bench")
        print(f"store: {info.tables['requests']:,} request rows, rows per table {info.tables}, ready in {gen_s:.1f} s")
        first = open_run(store, "bench").table("requests", columns=[col.REQUEST_ID]).slice(0, 1)
        request = str(first.column(0)[0].as_py())  # the first request written
        paths = ([p + ("?run=bench" if p != "/compare" else f"?run=bench&base={BASELINE}") for p in VIEWS]
                 + [f"/explorer?run=bench&request={request}"])

        t = time.perf_counter()
        written = {r: derive(open_run(store, r)) for r in ("bench", BASELINE)}  # as the dashboard does before a
        # finished run's first analysis
        print(f"derived facts ({'; '.join(f'{r}: ' + (', '.join(w) or 'already current') for r, w in written.items())})"
              f" in {time.perf_counter() - t:.1f} s")
        app = create_app(store)
        analyzer_s = _time_analyzers(app, "bench")
        print("analyzer calls, cold (s):")
        for name, s in sorted(analyzer_s.items(), key=lambda kv: -kv[1]):
            print(f"  {name:<50} {s:8.2f}{'   over the 3 s target' if s > TARGET_S else ''}")
        server, url = _serve(app)
        warm = _browse(url, paths, work, "warm", fresh=False)
        _show("first render per view, analyses cached on the server, one browser (s):", warm)
        _show("the same, each view in a fresh browser profile (s):", _browse(url, paths, work, "fresh", fresh=True))
        server.shutdown()
        cold: dict[str, float] = {}
        if not args.skip_cold:
            cold_app = create_app(store)
            server, url = _serve(cold_app)

            def forget() -> None:  # a new data source: no cached result, analysis, connection or run listing
                cold_app.server.config[SOURCE_KEY] = DataSource(store)

            cold = _browse(url, paths, work, "cold", fresh=False, before_each=forget)
            server.shutdown()
            _show("first render per view, nothing cached on the server (analyzers run on demand), one browser (s):",
                  cold)
        print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
              f"load average {' '.join(f'{x:.1f}' for x in os.getloadavg())} (1, 5, 15 min; other processes "
              f"compete for the CPUs)")
        if cold:
            print(f"slowest_view_cold_render_s={max(cold.values()):.2f}")
        print(f"slowest_view_first_render_s={max(warm.values()):.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
