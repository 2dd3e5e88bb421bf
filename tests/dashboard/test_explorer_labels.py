"""The request explorer shows labels cut for display: a store holding a 100 KB tenant name (written
before labels were capped, or by another tool) renders cells, titles and options of at most
``SHOWN_LABEL_CHARS`` characters, so the browser never lays out the whole name."""

from __future__ import annotations

import json

import plotly
import pyarrow as pa
import pyarrow.parquet as pq
from synthetic_store import write_run

from dashboard.app import create_app
from dashboard.components.figures import SHOWN_LABEL_CHARS
from dashboard.components.shell import parse_query
from dashboard.data import DataSource
from tokentrace.schema import REQUESTS, col

HUGE = "x" * 100_000  # a tenant name
LONG_KEY = "k" * 8_000  # a request id


def _plant_long_labels(store, run: str) -> None:
    """Rewrite the run's requests parts (the synthetic writer bypasses the recorder and its caps)."""
    for part in sorted((store / run / REQUESTS.name).rglob("*.parquet")):
        table = pq.read_table(part)
        tenants = [HUGE if t == "acme" else t for t in table.column(col.TENANT).to_pylist()]
        keys = [LONG_KEY if k == "req-0" else k for k in table.column(col.REQUEST_KEY).to_pylist()]
        i, j = table.schema.get_field_index(col.TENANT), table.schema.get_field_index(col.REQUEST_KEY)
        table = table.set_column(i, table.schema.field(i), pa.array(tenants, table.schema.field(i).type))
        table = table.set_column(j, table.schema.field(j), pa.array(keys, table.schema.field(j).type))
        pq.write_table(table, part)


def _strings(node) -> list[str]:
    """Every string a rendered component tree carries, except dropdown option values (never shown)."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [s for x in node for s in _strings(x)]
    if isinstance(node, dict):
        return [s for k, v in node.items() if k != "value" for s in _strings(v)]
    return []


def test_a_100_kb_tenant_is_shown_cut(tmp_path):
    write_run(tmp_path, "base", num_requests=30, seed=3)
    _plant_long_labels(tmp_path, "base")
    create_app(tmp_path)  # registers the pages
    from dashboard.pages import explorer

    src = DataSource(tmp_path)
    q = parse_query({"run": "base", "sort": col.REQUEST_KEY})
    rendered = json.loads(json.dumps([explorer.body(src, q), explorer.controls(src, q)],
                                     cls=plotly.utils.PlotlyJSONEncoder))
    shown = _strings(rendered)
    assert any(s.startswith("x" * (SHOWN_LABEL_CHARS - 1) + "…") for s in shown)  # the huge tenant, cut
    assert max(len(s) for s in shown if set(s) <= {"x", "…", "k"}) <= SHOWN_LABEL_CHARS
    data, _ = explorer._fetch(src, q, 0)
    cut = "x" * (SHOWN_LABEL_CHARS - 1) + "…"
    assert cut in {r[col.TENANT] for r in data}
    assert all(len(r[col.REQUEST_KEY]) <= SHOWN_LABEL_CHARS for r in data)
