"""Derived facts: the relations every analysis starts from, each declared once and read through one door.

A derived fact is a table computed from a run's store tables that several analyses
share (per-token times, per-request latencies, per-token stage sums, ...). Each is
declared once, as a :class:`Fact`: its name, its columns (the schema, in the style of
:mod:`tokentrace.schema`: name, Arrow type, meaning) and how it is built from the
run's tables (a SQL ``SELECT`` over the views of :class:`~analyzers.source.Source`,
or a function that materializes it). The declaration lives beside the analysis that
owns the concept (``analyzers.timing.TOKEN_TIMES``); the registry of every fact is
:data:`analyzers.derivation.FACTS`.

:func:`relation` is the one door: it returns the name of a relation holding the fact's
rows, whatever their origin:

* the run's saved copy, ``<run>/_derived/<fact>.parquet``
  (:mod:`tokentrace.store.derived`), when it is current: written by
  :func:`analyzers.derivation.derive` for exactly the run's part files (their
  fingerprint), for this code (:func:`format_key`) and with the fact's declared
  columns (:meth:`Fact.signature`), its bytes checked against their digest the first
  time the door opens it (only the files an analysis reads are hashed); a stale,
  foreign or corrupted file is never read;
* else the fact built now, as a temporary table of the source's engine.

Both hold the declared columns with the declared types (the saved file is written from
the relation this door builds), so an analysis has one code path and cannot tell
where its rows came from, only that they came sooner. The door is looked up once per
source and fact.

:func:`rows_for` is the same door for some of a fact's rows: those whose key columns
(:attr:`Fact.keys`) are in a relation the analysis holds (the tail tokens of a
breakdown, say). From the saved file, or from the fact built already, they are read
through :func:`relation`; otherwise a fact that declares ``select_only`` builds just
those rows (a per-token fact over a few thousand tokens costs a fraction of the
whole), and any other fact is built whole first. The rows are the same either way.
:func:`summary_and_rows` gives a fact's rows summed per group of requests
(:attr:`Fact.summary`) and some rows of another fact: read from the first fact's
relation when it is at hand, else built in one pass over the run's tables without
the fact's rows, when the fact declares how (:attr:`Fact.summary_along`: a breakdown's
stage totals per group and its tail tokens' per-token sums, from a run nothing was
derived for, cost one join of the spans to the tokens and a grouping into a few rows).

This module imports no analysis (so the source and every analysis may import it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Callable

import pyarrow as pa

from tokentrace.schema import SCHEMA_VERSION, Column, Stage
from tokentrace.store.derived import DerivedFile, read_derived

__all__ = ["Fact", "FORMAT_VERSION", "format_key", "saved_metadata", "attach", "relation", "rows_for",
           "summary_and_rows", "stream_rows",
           "read_from",
           "is_at_hand", "is_saved", "i64", "i32", "i8", "f64", "text", "boolean", "SQL_TYPES"]

FORMAT_VERSION = 3
"""Bump when what a fact means changes while its columns stay (a new definition of a token's interval): files
of another version are stale. A change of a fact's declared columns changes :func:`format_key` by itself."""

_FILES_KEY = "saved_facts"  # Source cache key: fact name -> DerivedFile of the run's current saved facts
_SIGNATURE_KEY = "signature"  # extra metadata of a saved fact: Fact.signature()

SQL_TYPES: dict[pa.DataType, str] = {pa.int8(): "TINYINT", pa.int32(): "INTEGER", pa.int64(): "BIGINT",
                                     pa.float64(): "DOUBLE", pa.string(): "VARCHAR", pa.bool_(): "BOOLEAN",
                                     pa.list_(pa.float64()): "DOUBLE[]"}
"""Arrow type of a fact column -> the SQL type it is cast to (DuckDB's names; Spark's engine translates)."""


def i64(name: str, doc: str) -> Column:
    """A 64-bit integer column of a fact."""
    return Column(name, pa.int64(), doc)


def i32(name: str, doc: str) -> Column:
    return Column(name, pa.int32(), doc)


def i8(name: str, doc: str) -> Column:
    return Column(name, pa.int8(), doc)


def f64(name: str, doc: str) -> Column:
    return Column(name, pa.float64(), doc)


def text(name: str, doc: str) -> Column:
    return Column(name, pa.string(), doc)


def boolean(name: str, doc: str) -> Column:
    return Column(name, pa.bool_(), doc)


@dataclass(frozen=True, slots=True)
class Fact:
    """One derived fact: its name, its columns and how it is built from a run's tables.

    ``select(src)``: a SQL ``SELECT`` of its rows over the source's views (it may run other facts' doors first).
    ``build(src, table)``, instead of ``select``: materializes the rows as temporary table ``table`` (at least
    the declared columns, in their types) when a plain ``SELECT`` would cost a second pass.
    ``keys``: the declared columns that identify a row (what :func:`rows_for` selects rows by).
    ``select_only(src, keys)``: a SQL ``SELECT`` of just the rows whose ``keys`` are in relation ``keys`` (distinct
    key tuples, maybe other columns): the same rows as ``select`` gives for them, built without the others.
    ``summary(src, rows, groups)``: a SQL ``SELECT`` of the fact's rows summed per group of requests: ``rows`` a
    relation of the fact's rows, ``groups`` a relation of (request_id, grp) pairs, or None: one group, grp 0, of
    every row.
    ``summary_along``: ``(other, build)`` when one pass over the run's tables can build that summary without the
    fact's rows, and some rows of fact ``other``: ``build(src, groups, keys, table, rows)`` materializes the
    summary as temporary table ``table`` and ``other``'s rows for the keys in relation ``keys`` (those
    :func:`rows_for` gives) as temporary table ``rows`` (:func:`summary_and_rows`).
    """

    name: str
    doc: str
    columns: tuple[Column, ...]
    select: Callable[[Any], str] | None = None
    build: Callable[[Any, str], None] | None = None
    keys: tuple[str, ...] = ()
    select_only: Callable[[Any, str], str] | None = None
    summary: Callable[[Any, str, str | None], str] | None = None
    summary_along: "tuple[Fact, Callable[[Any, str | None, str, str, str], None]] | None" = None

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"a fact's name must be an identifier, got {self.name!r}")
        if (self.select is None) == (self.build is None):
            raise ValueError(f"fact {self.name}: give exactly one of select, build")
        unknown = [c.name for c in self.columns if c.type not in SQL_TYPES]
        if unknown:
            raise ValueError(f"fact {self.name}: no SQL type for column(s) {', '.join(unknown)}")
        if not set(self.keys) <= set(self.names):
            raise ValueError(f"fact {self.name}: keys {self.keys} are not all declared columns")
        if self.select_only is not None and not self.keys:
            raise ValueError(f"fact {self.name}: select_only needs keys")
        if self.summary_along is not None and (self.summary is None or not self.summary_along[0].keys):
            raise ValueError(f"fact {self.name}: summary_along needs a summary and a fact with keys")

    @property
    def names(self) -> tuple[str, ...]:
        """The declared column names, in order."""
        return tuple(c.name for c in self.columns)

    @property
    def schema(self) -> pa.Schema:
        """The fact's Arrow schema (each field with its doc)."""
        return pa.schema([c.field() for c in self.columns])

    def rows_sql(self, relation_name: str) -> str:
        """SELECT of the declared columns of ``relation_name``, each cast to its declared type."""
        return "SELECT " + ", ".join(f"CAST({c.name} AS {SQL_TYPES[c.type]}) AS {c.name}" for c in self.columns) \
            + f" FROM {relation_name}"

    def materialize(self, src: Any, table: str) -> None:
        """Build the fact now from the run's tables, as temporary table ``table`` of ``src``'s engine."""
        if self.build is not None:
            self.build(src, table)
            return
        assert self.select is not None
        src.execute(f"CREATE OR REPLACE TEMP TABLE {table} AS {self.rows_sql(f'({self.select(src)})')}")

    def signature(self) -> str:
        """A digest of the name and the declared columns with their types (a saved file must have the same)."""
        text = self.name + "(" + ",".join(f"{c.name}:{c.type}" for c in self.columns) + ")"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def format_key() -> str:
    """What this code derives: the facts' version, the schema version and every stage id it knows. (Each saved
    file also carries its fact's :meth:`Fact.signature`: a fact whose declared columns changed is not read.)"""
    return f"{FORMAT_VERSION}/{SCHEMA_VERSION}/" + ",".join(str(int(s)) for s in Stage)


def saved_metadata(fact: Fact) -> dict[str, str]:
    """The extra metadata a saved file of ``fact`` is written with (what :func:`relation` checks it by)."""
    return {_SIGNATURE_KEY: fact.signature()}


def attach(src: Any, run: Any) -> None:
    """Look up the run's current saved facts once (:meth:`tokentrace.store.reader.Run.fingerprint`,
    :func:`format_key`), for the door of ``src`` (a Source on ``run``).

    Never raises for a missing, stale or unreadable folder: every fact is then built now.
    """
    files: dict[str, DerivedFile] = {}
    if getattr(run, "path", None) is not None:
        try:
            files = read_derived(run.path, run.fingerprint(), format_key(), verify=False)  # checked when opened
        except OSError:
            files = {}
    src.cached(_FILES_KEY, lambda: files)


def relation(src: Any, fact: Fact) -> str:
    """The one door: name of a relation of ``src``'s engine holding ``fact``'s rows (declared columns), read from
    the run's current saved file or built now (then kept as a temporary table for the source's lifetime)."""
    def open_() -> str:
        saved = _saved(src, fact)
        if saved is not None:
            view = f"saved_{fact.name}"
            src.engine.parquet_view(view, [([saved.path.as_posix()], {})])
            return view
        fact.materialize(src, fact.name)
        return fact.name
    return src.cached(_door_key(fact), open_)


def rows_for(src: Any, fact: Fact, keys: str) -> str:
    """The door for some rows: a SQL ``SELECT`` of ``fact``'s declared columns for the rows whose :attr:`Fact.keys`
    are in relation ``keys`` (distinct key tuples; other columns are ignored). Read from :func:`relation` when it
    costs nothing more (:func:`is_at_hand`) or the fact cannot build just those rows; else built for them only
    (``select_only``, not kept: the next call builds again)."""
    if not fact.keys:
        raise ValueError(f"fact {fact.name} declares no keys")
    if fact.select_only is not None and not is_at_hand(src, fact):
        return fact.rows_sql(f"({fact.select_only(src, keys)})")
    on = " AND ".join(f"k.{name} = w.{name}" for name in fact.keys)
    return (f"SELECT {', '.join(f'w.{name}' for name in fact.names)} "
            f"FROM {relation(src, fact)} w JOIN {keys} k ON {on}")


def summary_and_rows(src: Any, fact: Fact, groups: str | None, other: Fact, keys: str) -> tuple[str, str]:
    """:attr:`Fact.summary` of ``fact`` per ``groups`` (a relation of (request_id, grp) pairs, or None: one group)
    and :func:`rows_for` of ``other`` for the keys in relation ``keys``: from ``fact``'s relation when it is at hand
    (:func:`is_at_hand`) or declares no way along ``other``, else both built in one pass over the run's tables
    (:attr:`Fact.summary_along`), without ``fact``'s rows. The same sums and rows either way."""
    if fact.summary is None:
        raise ValueError(f"fact {fact.name} declares no summary")
    along = fact.summary_along
    if along is None or along[0] is not other or is_at_hand(src, fact):
        return f"({fact.summary(src, relation(src, fact), groups)})", rows_for(src, other, keys)
    table, rows = f"{fact.name}_summary", f"{other.name}_rows"  # replaced by the next call (not kept)
    along[1](src, groups, keys, table, rows)
    return table, other.rows_sql(rows)


def stream_rows(src: Any, fact: Fact, batch_rows: int) -> Any:
    """``fact``'s declared columns as a stream of record batches: from its relation when the source has opened
    it already, else straight from its query (a fact with a ``select`` is then not materialized first)."""
    if fact.select is not None and not src.is_cached(_door_key(fact)) and _saved(src, fact) is None:
        return src.arrow_stream(fact.rows_sql(f"({fact.select(src)})"), batch_rows)
    return src.arrow_stream(fact.rows_sql(relation(src, fact)), batch_rows)


def read_from(src: Any, fact: Fact, path: Any) -> None:
    """From now on, ``src``'s door gives ``fact``'s rows from the Parquet file at ``path`` (just written from them)."""
    def open_() -> str:
        view = f"saved_{fact.name}"
        src.engine.parquet_view(view, [([path.as_posix()], {})])
        return view
    if not src.is_cached(_door_key(fact)):
        src.cached(_door_key(fact), open_)


def is_at_hand(src: Any, fact: Fact) -> bool:
    """True when :func:`relation` of ``fact`` costs nothing more: saved, or built already for this source."""
    return is_saved(src, fact) or src.is_cached(_door_key(fact))


def is_saved(src: Any, fact: Fact) -> bool:
    """True when the run has a current saved copy of ``fact`` (what :func:`relation` then reads)."""
    return _saved(src, fact) is not None


def _saved(src: Any, fact: Fact) -> DerivedFile | None:
    """The run's saved file of ``fact``: current for its part files and this code, with the declared columns, and
    its bytes those it was written with (checked once per source, the first time the door asks for it)."""
    found = src.cached(_FILES_KEY, dict).get(fact.name)
    if found is None or found.extra.get(_SIGNATURE_KEY) != fact.signature():
        return None
    return found if src.cached(f"intact:{fact.name}", found.is_intact) else None


def _door_key(fact: Fact) -> str:
    return f"fact:{fact.name}"
