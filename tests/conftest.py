"""Fixtures shared by every test folder: the planted-fault runs of :mod:`planted_runs`; and the grouping of tests
for parallel workers.

``planted_run(kind, mode)`` builds the run the first time a test of the session asks for it
(a few seconds of load against the real reference server) and returns the same
:class:`planted_runs.PlantedRun` afterwards. All runs of a session share one store folder.

Under pytest-xdist (``-n N --dist loadgroup``, the README's test command) each worker is a session of its own,
so a session-, module- or class-scoped fixture would be built again by every worker that runs one of its tests.
The tests that share such a fixture (one defined in these test folders), directly or through other tests,
form one group, and a group runs on one worker: each fixture is still built once per run. Each worker
writes the groups it collected to a file the controller names (:func:`pytest_configure_node`,
:func:`pytest_collection_finish`); the controller's scheduler (:class:`FixtureGroupScheduling`, xdist's
``loadgroup`` scheduler) reads them to make its units of work. Tests outside every group are sent one by one.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.append(str(Path(__file__).resolve().parent))  # planted_runs (appended: test folders put their own first)

from planted_runs import PlantedRun, build_run  # noqa: E402


@pytest.fixture(scope="session")
def planted_store(tmp_path_factory) -> Path:
    """The store folder every planted run of this session is written to."""
    return tmp_path_factory.mktemp("planted")


@pytest.fixture(scope="session")
def planted_run(planted_store) -> Callable[[str, str], PlantedRun]:
    """``planted_run(kind, mode)``: the planted run, built once per session when first asked for."""
    built: dict[tuple[str, str], PlantedRun] = {}

    def get(kind: str, mode: str) -> PlantedRun:
        if (kind, mode) not in built:
            built[kind, mode] = build_run(planted_store, kind, mode)
        return built[kind, mode]

    return get



# ------------------------------------------------------------------------------------- parallel workers

# Test modules that need the machine to themselves: marked ``serial``; the README's test command runs them in a
# second, serial pytest after the parallel one (``-m "not serial"``, then ``-m serial``).
SERIAL = {
    # measures the real engine's latencies against the what-if predictions: a second worker's load skews them
    "analyzers/whatif/test_real_runs.py",
    # sets the machine's load itself (idle, then both cores busy) and judges attribution under exactly that
    "instrument/test_independent_client.py",
    # needs the decode worker's token-0 work to outlast token 0's delivery, which a second worker's load can end
    "analyzers/test_disagg_preemption.py",
}

TESTS = Path(__file__).resolve().parent
SHARED_SCOPES = ("session", "package", "module", "class")
CHEAP = frozenset({"make_store", "serve_app"})  # session fixtures that hand out a class or a function
GROUPS_DIR = "tokentrace_groups_dir"  # the worker input naming the folder the workers write their groups to


def _defined_here(fixturedef: Any) -> bool:
    try:
        return Path(inspect.getfile(fixturedef.func)).resolve().is_relative_to(TESTS)
    except (TypeError, OSError):
        return False


def _shared_fixtures(item: pytest.Item) -> list[str]:
    """One key per built instance of the session-, package-, module- or class-scoped fixtures of these folders
    that ``item`` uses (a module's or a class's own instance, a parametrized fixture's parameter)."""
    keys: list[str] = []
    info = getattr(item, "_fixtureinfo", None)  # items that are not test functions use no fixture
    if info is None:
        return keys
    callspec = getattr(item, "callspec", None)
    where = Path(str(item.path)).relative_to(TESTS).as_posix() if Path(str(item.path)).is_relative_to(TESTS) else ""
    for name in info.names_closure:
        defs = info.name2fixturedefs.get(name)
        if not defs or name in CHEAP:
            continue
        fixturedef = defs[-1]
        if fixturedef.scope not in SHARED_SCOPES or not _defined_here(fixturedef):
            continue
        key = f"{fixturedef.baseid}:{name}"
        if fixturedef.scope == "module":
            key = f"{where}:{name}"
        elif fixturedef.scope == "class" and item.cls is not None:
            key = f"{where}:{item.cls.__name__}:{name}"
        if callspec is not None and name in callspec.indices:
            key += f"#{callspec.indices[name]}"
        keys.append(key)
    return keys


def fixture_groups(items: list[pytest.Item]) -> dict[str, str]:
    """node id -> group, for the tests that share a built fixture: the tests connected through the fixtures
    they use make one group (named after its first fixture key, in sorted order)."""
    parent: dict[str, str] = {}

    def find(key: str) -> str:
        while parent.setdefault(key, key) != key:
            parent[key] = parent[parent[key]]
            key = parent[key]
        return key

    per_item = [_shared_fixtures(item) for item in items]
    for keys in per_item:
        for other in keys[1:]:
            a, b = find(keys[0]), find(other)
            if a != b:
                parent[max(a, b)] = min(a, b)
    return {item.nodeid: f"group:{find(keys[0])}" for item, keys in zip(items, per_item) if keys}


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Controller: name the folder each worker writes its groups to (one per run, removed at its end)."""
    config = node.config
    if not hasattr(config, "_tokentrace_groups_dir"):
        config._tokentrace_groups_dir = tempfile.mkdtemp(prefix="tokentrace-groups-")
    node.workerinput[GROUPS_DIR] = config._tokentrace_groups_dir


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = getattr(config, "_tokentrace_groups_dir", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Worker: write the groups of what it collected, before it tells the controller it has collected."""
    workerinput = getattr(session.config, "workerinput", None)
    if not workerinput or GROUPS_DIR not in workerinput:
        return
    path = Path(workerinput[GROUPS_DIR]) / f"{workerinput['workerid']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(fixture_groups(session.items)), encoding="utf-8")
    os.replace(tmp, path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadgroup``: xdist's group scheduler, with the fixture groups the workers wrote."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class FixtureGroupScheduling(LoadGroupScheduling):
        """A group of tests sharing a built fixture is one unit of work (one worker); the other tests go one by
        one. The largest units are sent first."""

        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self.groups is None:  # asked once every worker has collected, so every file is written
                self.groups = {}
                folder = Path(getattr(config, "_tokentrace_groups_dir", ""))
                for path in sorted(folder.glob("*.json")):
                    self.groups.update(json.loads(path.read_text(encoding="utf-8")))
            return self.groups.get(nodeid) or super()._split_scope(nodeid)

    return FixtureGroupScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.path))
        if path.is_relative_to(TESTS) and path.relative_to(TESTS).as_posix() in SERIAL:
            item.add_marker(pytest.mark.serial)
