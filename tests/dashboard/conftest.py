"""Fixtures for the dashboard tests: synthetic stores, a served app, a real headless Chromium.

The browser tests never skip: when Debian's ``chromium``/``chromium-driver`` or
selenium are missing they FAIL, naming what to install.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # synthetic_store, browser helpers

from synthetic_store import SyntheticRun, write_run  # noqa: E402

from tokentrace.schema import SPANS, STEPS  # noqa: E402

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
REPO = Path(__file__).resolve().parents[2]
SCREENSHOTS = REPO / "screenshots"
NUM_REQUESTS = 240
BIG_IDS = (5477211705032059102, 4030198795875324637, 6805339585145160198)
"""Gateway, engine and client ids as real runs have them (63-bit): a person must never see one."""


class Served:
    """A Dash app served by a werkzeug server thread on 127.0.0.1."""

    def __init__(self, app: Any) -> None:
        from werkzeug.serving import make_server

        self._server = make_server("127.0.0.1", 0, app.server, threaded=True)
        self.url = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="dashboard-test-server", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._thread.join(timeout=10)


@pytest.fixture(scope="session")
def stores() -> Iterator[dict[str, Any]]:
    """A store with runs ``partial`` (no spans, no steps), ``base`` and ``cand`` (slower), created in that order."""
    root = Path(tempfile.mkdtemp(prefix="tt-dash-"))
    store = root / "store"
    runs: dict[str, SyntheticRun] = {}
    runs["partial"] = write_run(store, "partial", num_requests=60, seed=7, omit=(SPANS.name, STEPS.name), dropped=5)
    time.sleep(0.01)  # creation times order the runs
    runs["base"] = write_run(store, "base", num_requests=NUM_REQUESTS, seed=1, instance_ids=BIG_IDS)
    time.sleep(0.01)
    runs["cand"] = write_run(store, "cand", num_requests=NUM_REQUESTS, seed=2, slowdown=1.6, instance_ids=BIG_IDS)
    empty = root / "empty"
    empty.mkdir()
    yield {"store": store, "runs": runs, "empty": empty, "missing": root / "missing", "root": root}
    shutil.rmtree(root, ignore_errors=True)


def _serve(store: Path, **kw: Any) -> Served:
    from dashboard.app import create_app

    return Served(create_app(store, **kw))


@pytest.fixture(scope="session")
def served(stores: dict[str, Any]) -> Iterator[Served]:
    s = _serve(stores["store"])
    yield s
    s.close()


@pytest.fixture(scope="session")
def serve() -> Iterator[Callable[..., Served]]:
    """Start more apps (other stores, live mode); all are stopped at the end of the session."""
    started: list[Served] = []

    def start(store: Path, **kw: Any) -> Served:
        s = _serve(store, **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """Headless Chromium driven by Selenium; FAILS (never skips) when it cannot be started."""
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    if missing:
        pytest.fail(f"browser tests need Debian's chromium and chromium-driver ({', '.join(missing)} missing): "
                    "apt-get install -y chromium chromium-driver", pytrace=False)
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.fail("browser tests need selenium: pip install selenium", pytrace=False)
    profile = tempfile.mkdtemp(prefix="tt-chromium-")
    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
                 "--window-size=1400,1000"):
        opts.add_argument(flag)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=opts)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)
