"""The plotly.js that tokentrace's browser views load: plotly.js's *basic* partial bundle.

``assets/plotly-basic.min.js`` (plotly.js 4.1.1, MIT; licence beside it) registers the
bar, scatter and pie trace types: every chart the HTML report and the dashboard draw.
It is 1.2 MB against the full bundle's 4.8 MB, which matters twice: the HTML report
inlines it (a CI artifact of about 1.3 MB instead of 5), and a browser parses and
compiles it before the first chart of a dashboard view appears. A chart that needs
another trace type (a heatmap, say) needs plotly.js's cartesian bundle here instead;
the browser tests check every drawn trace type against :data:`TRACE_TYPES`.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path

__all__ = ["BUNDLE_NAME", "TRACE_TYPES", "bundle_path", "bundle_text"]

BUNDLE_NAME = "plotly-basic.min.js"
TRACE_TYPES = frozenset({"bar", "scatter", "pie"})
"""The trace types the bundle registers."""


def bundle_path() -> Path:
    """The bundle's file in the installed package."""
    path = Path(str(resources.files("tokentrace.app.report") / "assets" / BUNDLE_NAME))
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: tokentrace is installed without its package data "
                                "(reinstall it with pip)")
    return path


@functools.cache
def bundle_text() -> str:
    """The bundle's JavaScript, read once per process."""
    return bundle_path().read_text(encoding="utf-8")
