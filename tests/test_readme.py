"""The README's two commands are what CI and a newcomer run."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _readme_commands() -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [line.strip() for b in blocks for line in b.splitlines() if line.strip().startswith("python3 -m venv")]


def test_readme_has_a_setup_plus_demo_and_a_setup_plus_tests_command():
    cmds = _readme_commands()
    assert any(c.endswith("tokentrace demo") for c in cmds), cmds
    assert any("pytest" in c for c in cmds), cmds
    for c in cmds:
        assert "-c constraints.txt" in c, f"set-up must pin torch through constraints.txt: {c}"


def test_ci_runs_exactly_the_readme_test_command():
    test_cmd = next(c for c in _readme_commands() if "pytest" in c)
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert "set -euo pipefail" in ci
    ci_lines = [line.strip() for line in ci.splitlines() if line.strip() and not line.strip().startswith("#")]
    assert ci_lines[-1] == test_cmd


def test_ci_runs_the_spark_tests_with_java_never_skipping_them():
    """The test command installs the spark extra and CI installs Debian's Java as root before it, so the
    cross-engine tests (tests/analyzers/test_engines.py) run in CI."""
    test_cmd = next(c for c in _readme_commands() if "pytest" in c)
    extras = re.search(r"-e '\.\[([\w,-]+)\]'", test_cmd)
    assert extras is not None and "spark" in extras.group(1).split(","), test_cmd
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert "apt-get install -y -qq default-jre-headless" in ci
    assert ci.index("default-jre-headless") < ci.index(test_cmd)
    pins = (REPO / "constraints.txt").read_text(encoding="utf-8")
    assert re.search(r"^pyspark==4\.", pins, re.M) and re.search(r"^sqlglot==", pins, re.M)


def test_constraints_pin_the_cpu_torch_while_metadata_keeps_a_range():
    constraints = (REPO / "constraints.txt").read_text(encoding="utf-8")
    assert "torch==2.13.0" in constraints
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert '"torch>=2.3"' in pyproject and "torch==" not in pyproject
