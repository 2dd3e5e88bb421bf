"""The manual-API examples of the README and docs/instrumenting.md pass the tool's own attribution check."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tokentrace

REPO = Path(__file__).resolve().parents[1]


def _readme_first_snippet() -> str:
    quick_start = (REPO / "README.md").read_text().split("## Quick start", 1)[1]
    return re.search(r"```python\n(.*?)```", quick_start, re.S).group(1)


def _my_engine() -> str:
    doc = (REPO / "docs" / "instrumenting.md").read_text()
    return re.search(r"save as\s*`my_engine\.py`\)?:?\s*```python\n(.*?)```", doc, re.S).group(1)


@pytest.mark.parametrize(("source", "store"), [(_readme_first_snippet, "traces/"), (_my_engine, "traces")])
def test_the_example_leaves_nothing_unattributed(tmp_path: Path, source, store: str) -> None:
    (tmp_path / "example.py").write_text(source())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "example.py"], cwd=tmp_path, env=env, check=True, timeout=120)
    analysis = tokentrace.open(tmp_path / store).analyze()
    assert len(analysis.latency()) > 0
    assert abs(analysis.unattributed_share()) < 0.01, analysis.attribution()
    assert analysis.overlap_share() < 0.01, analysis.attribution()
