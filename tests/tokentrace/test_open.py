"""``tokentrace.open`` says which run it picked when the store holds several."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import tokentrace
from tokentrace.store import StoreWriter


def _runs(store: Path, *names: str) -> None:
    for name in names:
        with StoreWriter(store, run_id=name):
            pass


def test_several_runs_name_the_one_opened_and_the_others(tmp_path: Path) -> None:
    _runs(tmp_path, "first", "second")
    with pytest.warns(UserWarning, match=r"holds 2 runs; opened the newest, 'second' \(others: first\); pass run="):
        run = tokentrace.open(tmp_path)
    assert run.run_id == "second"


def test_one_run_or_a_chosen_run_opens_silently(tmp_path: Path) -> None:
    _runs(tmp_path / "one", "only")
    _runs(tmp_path / "two", "a", "b")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tokentrace.open(tmp_path / "one").run_id == "only"
        assert tokentrace.open(tmp_path / "two", run="a").run_id == "a"
        assert tokentrace.open(tmp_path / "two" / "a").run_id == "a"  # a run's own folder
