"""The linter runs inside the suite, so CI fails on any finding.

ruff's rules and settings are in ``pyproject.toml`` (pyflakes: undefined
names, unused imports and variables, redefinitions; syntax errors; import
order). Pyflakes lets a redefinition through when the first definition was
used inside a function body before the second replaced it, so a second check
here finds any name defined twice at the top of a module or class.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CODE = ("tokentrace", "instrument", "analyzers", "dashboard", "reference_server", "benchmarks", "tests")


def test_ruff_finds_nothing():
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def redefinitions(source: str) -> list[str]:
    """Names a module or class body defines (``def``/``class``) more than once."""
    found = []
    for scope in [ast.parse(source), *(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef))]:
        names = Counter(n.name for n in scope.body
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                        and not any(_is_overload_or_property_setter(d) for d in n.decorator_list))
        found += [name for name, count in names.items() if count > 1]
    return found


def _is_overload_or_property_setter(decorator: ast.expr) -> bool:
    if isinstance(decorator, ast.Name):
        return decorator.id == "overload"
    return isinstance(decorator, ast.Attribute) and decorator.attr in ("setter", "deleter", "overload")


def test_no_function_or_class_is_defined_twice():
    twice = []
    for folder in CODE:
        for path in (REPO / folder).rglob("*.py"):
            twice += [f"{path.relative_to(REPO)}: {name}" for name in redefinitions(path.read_text())]
    assert not twice, "defined twice: " + ", ".join(twice)


def test_the_redefinition_check_catches_what_pyflakes_lets_through():
    source = "def f():\n    return g()\n\ndef g():\n    return 1\n\ndef g():\n    return 2\n"
    assert redefinitions(source) == ["g"]
    assert redefinitions("class A:\n    @property\n    def x(self): ...\n    @x.setter\n    def x(self, v): ...\n") == []
