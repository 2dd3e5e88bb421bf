"""report.md from a run whose tenants, SLO classes and instance are named by an attacker: no HTML, link or
broken table reaches a Markdown viewer (CI summaries and wikis render the HTML inside Markdown)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import tokentrace
from tokentrace.app.report import make_report, render

torch.set_num_threads(1)

PAYLOADS = ("<img src=x onerror=alert(1)>", "<script>alert(2)</script>", "<svg onload=alert(3)>",
            "[click](javascript:alert(4))", "a|b\nc&amp;")
OWN_TAGS = ("<details>", "</details>", "<summary>", "</summary>")  # the report's own collapsible block


@pytest.fixture(scope="module")
def hostile_store(tmp_path_factory) -> Path:
    from reference_server.engine.config import EngineConfig, TenantConfig
    from reference_server.engine.engine import Engine
    from reference_server.model import SamplingParams

    store = tmp_path_factory.mktemp("hostile-store")
    config = EngineConfig(model="tiny", block_size=4, num_device_blocks=128,
                          tenants=tuple(TenantConfig(p) for p in PAYLOADS), default_tenant=PAYLOADS[0])
    engine = Engine(config)
    handle = tokentrace.instrument(engine, store=store, run="hostile", name="<b onmouseover=alert(5)>engine</b>")
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    for i in range(3 * len(PAYLOADS)):
        engine.add_request(f"<i>req-{i}</i>", f"prompt {i}", sampling, tenant=PAYLOADS[i % len(PAYLOADS)],
                           slo_class="interactive")
    while engine.has_unfinished():
        engine.step()
    handle.close()
    engine.close()
    return store


def test_no_html_link_or_broken_row_from_hostile_names(hostile_store):
    md = render(make_report(hostile_store, "hostile"), "md")
    assert "&lt;script&gt;" in md or "&lt;img" in md  # the names are there, shown as text
    rest = md
    for tag in OWN_TAGS:
        rest = rest.replace(tag, "")
    assert "<" not in rest, [line for line in rest.splitlines() if "<" in line][:3]
    assert re.search(r"(?<!\\)\[[^\]]*\]\(javascript:", md) is None  # no link can be formed
    assert "&amp;amp;" in md  # an entity in a name is shown as written, not decoded into markup
    for line in md.splitlines():  # every table row has as many cells as its header
        if line.startswith("|"):
            cells = re.split(r"(?<!\\)\|", line.strip())
            assert cells[0] == "" and cells[-1] == "", line


def test_table_rows_keep_their_shape_with_pipes_and_newlines_in_names():
    import pandas as pd

    from tokentrace.app.report.render_md import markdown_table

    table = markdown_table(pd.DataFrame({"tenant": ["a|b\nc", "<x>"], "requests": [1, 2]}))
    lines = table.splitlines()
    assert len(lines) == 4
    assert [len(re.split(r"(?<!\\)\|", line)) for line in lines] == [4, 4, 4, 4]
    assert "a\\|b c" in lines[2] and "&lt;x&gt;" in lines[3]
