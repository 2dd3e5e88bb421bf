"""The Sessions view in a real headless Chromium: a store with two runs of the planted session workload of
``tests/analyzers/session_runs`` (retention ``drop``: every carried token lost; ``offload``: every carried token
reused from the host tier) and a run without sessions (one sentence). Screenshot: ``screenshots/sessions.png``."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest
from browser import graph_points, screenshot, severe_logs, texts, visit, what_people_see
from conftest import SCREENSHOTS
from synthetic_store import write_run

sys.path.append(str(Path(__file__).resolve().parents[1] / "analyzers"))  # the shared session workload

from session_runs import run_sessions  # noqa: E402

from tokentrace.app.report.sessions import NO_SESSIONS  # noqa: E402
from tokentrace.schema import col  # noqa: E402

pytestmark = pytest.mark.timeout(120)

_GRAPHS_JS = """
const out = {};
for (const g of document.querySelectorAll('.dash-graph')) {
  const gd = g.querySelector('.js-plotly-plot');
  if (!gd) continue;
  out[g.id] = gd.data.map(t => ({name: t.name, x: Array.from(t.x || []), y: Array.from(t.y || [])}));
}
return out;
"""


@pytest.fixture(scope="module")
def sessions_served(serve, tmp_path_factory):
    store = tmp_path_factory.mktemp("sessions")
    write_run(store, "plain", num_requests=20, seed=3)
    time.sleep(0.01)  # creation times order the runs
    run_sessions(policy="drop", num_turns=2, num_device_blocks=64, filler=0, store=store, run_id="drop")
    run_sessions(policy="offload", num_turns=2, num_device_blocks=12, num_host_blocks=32, filler=12, store=store,
                 run_id="offload")
    return serve(store)


@pytest.mark.parametrize(("run", "series", "sentence"), [
    ("drop", "lost during think time", "48 carried tokens were lost during think time"),
    ("offload", "reused from host", "host 48"),
])
def test_the_view_shows_reuse_by_tier_and_what_was_lost(browser, sessions_served, run, series, sentence):
    visit(browser, sessions_served.url + f"/sessions?run={run}")
    points = graph_points(browser)
    assert points.get("sessions-reuse", 0) > 0 and points.get("sessions-time", 0) > 0, points
    graphs = browser.execute_script(_GRAPHS_JS)
    reuse = {t["name"]: t for t in graphs["sessions-reuse"]}
    assert reuse[series]["x"] == ["1"] and reuse[series]["y"] == [48]  # turn 1 of both sessions: 24 + 24 tokens
    assert sentence in " ".join(texts(browser, "#sessions-sentences p"))
    headers = texts(browser, "#sessions-table th")
    assert col.SESSION not in headers and "lost_tokens" not in headers
    seen = what_people_see(browser)
    assert not [t for t in seen["svg"] if re.search(r"\d[eE][+-]?\d", t)]
    assert not texts(browser, ".tt-error")
    assert severe_logs(browser) == []
    if run == "drop":
        screenshot(browser, SCREENSHOTS / "sessions.png")


def test_a_run_without_sessions_says_so_in_one_sentence(browser, sessions_served):
    visit(browser, sessions_served.url + "/sessions?run=plain")
    assert NO_SESSIONS in " ".join(texts(browser, ".tt-notice"))
    assert graph_points(browser) == {}
    assert "Sessions" in " ".join(texts(browser, ".tt-nav-link"))
    assert severe_logs(browser) == []
