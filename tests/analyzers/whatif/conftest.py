"""Puts this folder on ``sys.path`` so the what-if tests import their ``engine_runs`` helper."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent))  # engine_runs (appended, as tests/analyzers/conftest.py does)
