"""Opening the runs a report or an export reads, and refusing the ones it cannot use.

Bad input is one :class:`ReportInputError` (a ``ValueError``) with one sentence:
a store reference that does not name a run, a run without the tables every
report needs (requests and tokens), or a store file that cannot be read. A
corrupt file is refused rather than skipped: a CI gate computed on part of a
run would pass or fail for the wrong reason.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

from tokentrace.schema import REQUESTS, TABLES, TOKENS
from tokentrace.store.manifest import CorruptFileWarning

__all__ = ["ReportInputError", "REQUIRED_TABLES", "split_run_ref", "expand_run_ref", "open_checked", "table_rows"]

REQUIRED_TABLES: tuple[str, ...] = (REQUESTS.name, TOKENS.name)
"""Tables without which there is nothing to report (no request and no token latency)."""


class ReportInputError(ValueError):
    """A run that cannot be reported on; the message is one sentence."""


def split_run_ref(ref: str) -> tuple[Path, str | None]:
    """``STORE[:RUN]`` -> (store path, run id or None).

    A reference that is an existing path is a store (even if it holds a colon);
    otherwise the text after the last colon is the run id.
    """
    if not ref:
        raise ReportInputError("an empty store reference was given; write STORE or STORE:RUN")
    if os.path.exists(ref) or ":" not in ref:
        return Path(ref), None
    store, run = ref.rsplit(":", 1)
    if not store or not run:
        raise ReportInputError(f"cannot read store reference {ref!r}; write STORE or STORE:RUN")
    return Path(store), run


def expand_run_ref(ref: str) -> list[tuple[Path, str | None]]:
    """``STORE[:RUN]`` as (store, run) pairs: one, or, when RUN is a pattern (``*`` and ``?`` as in file names:
    ``STORE:*`` is every run of the store, ``STORE:nightly-*`` those named so), every run whose id matches, oldest
    first. ``ReportInputError`` when a pattern matches no run."""
    import fnmatch

    from tokentrace.store.reader import find_run_dirs

    store, run = split_run_ref(ref)
    if run is None or not any(ch in run for ch in "*?["):
        return [(store, run)]
    names = [d.name for d in find_run_dirs(store)]
    matched = [n for n in names if fnmatch.fnmatchcase(n, run)]
    if not matched:
        raise ReportInputError(f"no run of store {store} matches {run!r}; runs: {', '.join(names[-10:])}")
    return [(store, n) for n in matched]


def table_rows(run: Any) -> dict[str, int]:
    """Rows per store table of ``run`` from the file footers; ``ReportInputError`` on a corrupt file."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CorruptFileWarning)
        rows = {name: run.num_rows(name) for name in TABLES}
    corrupt = [w for w in caught if issubclass(w.category, CorruptFileWarning)]
    if corrupt:
        more = f" (and {len(corrupt) - 1} more)" if len(corrupt) > 1 else ""
        raise ReportInputError(f"run {run.run_id} has an unreadable file{more}: {corrupt[0].message}")
    return rows


def open_checked(store: str | os.PathLike[str], run: str | None = None, *,
                 required: tuple[str, ...] = REQUIRED_TABLES) -> tuple[Any, dict[str, int]]:
    """Open run ``run`` of ``store`` and check it: every file readable, ``required`` tables non-empty.

    Returns (run, rows per table). Raises ``ReportInputError`` (or the reader's
    ``StoreError``, also a ``ValueError``) with one sentence.
    """
    from tokentrace.store import open_run

    opened = open_run(store, run)
    rows = table_rows(opened)
    missing = [name for name in required if rows.get(name, 0) == 0]
    if missing:
        raise ReportInputError(f"run {opened.run_id} in {Path(store)} has no {' and no '.join(missing)} rows: "
                               f"nothing to report (was the server traced while it served requests?)")
    return opened, rows

