"""Driving the dashboard in a real browser: wait for a view to finish, read its graphs, screenshots.

Shared by the browser tests and ``benchmarks/dashboard.py``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

__all__ = ["SCREENSHOT_NAMES", "visit", "wait_rendered", "severe_logs", "graph_points", "screenshot", "texts",
           "RENDER_TIMEOUT_S", "what_people_see"]

RENDER_TIMEOUT_S = 60.0
SCREENSHOT_NAMES: dict[str, str] = {
    "/": "overview.png", "/capacity": "capacity.png", "/breakdown": "breakdown.png", "/explorer": "explorer.png", "/queues": "queues.png",
    "/cache": "cache.png", "/pd-ratio": "pd-ratio.png", "/batch": "batch.png", "/tenants": "tenants.png",
    "/compare": "compare.png",
}
"""File name of each view's screenshot under ``screenshots/``."""

# True once the page's view is in the DOM, no Dash callback is pending and every graph is drawn.
_RENDERED_JS = """
const page = document.querySelector('#_pages_content .tt-page');
if (!page) return false;
if (document.querySelector('[data-dash-is-loading="true"]')) return false;
if (document.querySelector('.dash-graph--pending')) return false;
return Array.from(document.querySelectorAll('.dash-graph')).every(g => {
  const gd = g.querySelector('.js-plotly-plot') || (g.classList.contains('js-plotly-plot') ? g : null);
  return gd && gd._fullLayout && gd._fullData && gd.querySelector('.main-svg');
});
"""

_POINTS_JS = """
const out = {};
for (const g of document.querySelectorAll('.dash-graph')) {
  const gd = g.querySelector('.js-plotly-plot');
  if (!gd || !gd.data) { out[g.id] = -1; continue; }
  // finite numbers on the value axis (y; x for horizontal bars, or when y holds categories)
  const finite = a => Array.from(a || []).filter(v => typeof v === 'number' && isFinite(v)).length;
  let n = 0;
  for (const t of gd.data) {
    const main = t.orientation === 'h' ? t.x : t.y;
    n += finite(main) || finite(t.orientation === 'h' ? t.y : t.x);
  }
  out[g.id] = n;
}
return out;
"""


# What a person reads on the page: its text, the graphs' trace names (legends), their drawn texts (ticks, bar
# labels, annotations), every number or numeric string the graphs were sent, and the tables' data cells.
_PEOPLE_JS = """
const out = {text: document.body.innerText, names: [], svg: [], numbers: [], table_ids: []};
for (const gd of document.querySelectorAll('.js-plotly-plot')) {
  for (const t of (gd.data || [])) {
    if (t.name) out.names.push(t.name);
    for (const key of ['x', 'y', 'base', 'customdata', 'text']) {
      const values = t[key];
      if (!values || typeof values !== 'object' || !('length' in values)) continue;
      for (const v of Array.from(values).flat()) {
        if (typeof v === 'number' || typeof v === 'string') out.numbers.push(v);
      }
    }
  }
  for (const e of gd.querySelectorAll('text')) out.svg.push(e.textContent);
}
return out;
"""


def what_people_see(driver: Any) -> dict[str, Any]:
    """The page's text, legend names, texts drawn in graphs, and the values the graphs were sent."""
    return driver.execute_script(_PEOPLE_JS)


def wait_rendered(driver: Any, *, timeout_s: float = RENDER_TIMEOUT_S) -> float:
    """Block until the current view is rendered (twice in a row, 50 ms apart); seconds waited."""
    start = time.perf_counter()
    ok_in_a_row = 0
    while ok_in_a_row < 2:
        if time.perf_counter() - start > timeout_s:
            raise TimeoutError(f"view at {driver.current_url} not rendered within {timeout_s:.0f} s")
        ok_in_a_row = ok_in_a_row + 1 if driver.execute_script(_RENDERED_JS) else 0
        time.sleep(0.05)
    return time.perf_counter() - start


def visit(driver: Any, url: str, *, timeout_s: float = RENDER_TIMEOUT_S) -> float:
    """Load ``url`` and wait until its view is rendered; seconds from navigation to rendered."""
    start = time.perf_counter()
    driver.get(url)
    wait_rendered(driver, timeout_s=timeout_s)
    return time.perf_counter() - start


def severe_logs(driver: Any) -> list[dict[str, Any]]:
    """Browser console entries of level SEVERE since the last call."""
    return [e for e in driver.get_log("browser") if e.get("level") == "SEVERE"]


def graph_points(driver: Any) -> dict[str, int]:
    """Graph id -> number of finite data values over its traces (-1: not drawn)."""
    return driver.execute_script(_POINTS_JS)


def texts(driver: Any, css: str) -> list[str]:
    """Visible text of every element matching ``css``."""
    return [e.text for e in driver.find_elements("css selector", css)]


def screenshot(driver: Any, path: Path, *, width: int = 1400) -> Path:
    """A PNG of the whole page (the window grows to the page's height first)."""
    height = driver.execute_script("return Math.max(document.body.scrollHeight, 800)")
    driver.set_window_size(width, min(int(height) + 120, 12000))
    time.sleep(0.3)  # let Plotly redraw at the new size
    path.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(path))
    driver.set_window_size(width, 1000)
    return path
