"""Fixtures for the analyzer tests: hand-made stores (:mod:`handmade`) and simulated runs (:mod:`simulated`).

``handmade`` (a fixture) returns a fresh :class:`handmade.HandMade`; ``make_store`` the class itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parent))  # the handmade and simulated helpers (appended: other
# test folders put their own conftest first on the path and import it by name)

from handmade import HandMade  # noqa: E402


@pytest.fixture
def handmade() -> HandMade:
    return HandMade()



@pytest.fixture(scope="session")
def make_store() -> type[HandMade]:
    """The builder class itself, for tests (e.g. hypothesis) that build many stores."""
    return HandMade
