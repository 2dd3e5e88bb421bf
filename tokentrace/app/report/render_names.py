"""People's names for what the store identifies by integers, and readable column headers.

Instances are 64-bit integers in the store; a person reads ``prefill-0``. Every
view that shows an instance (the dashboard, the Markdown and HTML reports, the
demo) names it through :func:`instance_labels`, and never shows the integer: a
19-digit number means nothing to a reader, and JavaScript's numbers (doubles)
cannot even hold it (``4030198795875324637`` arrives as ``4030198795875324400``).
Where an id must travel to a browser or a JSON reader it goes as a string
(:func:`id_text`).

Result columns carry their unit in their name (``p99_ms``, ``served_rps``) or are
shares in 0..1; :func:`column_label` turns a column name into a header with its
unit (``p99 (ms)``, ``served (req/s)``, ``hit rate (%)``). Pure functions; no I/O.
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

import pandas as pd

from tokentrace.schema import Role, col

__all__ = ["INSTANCE", "instance_labels", "instance_label", "with_instance_names", "id_text", "column_label",
           "PERCENT_WORDS", "is_percent_column", "ID_COLUMNS", "for_people"]

INSTANCE = "instance"
"""Column that holds an instance's name where a table had its id."""
ID_COLUMNS: tuple[str, ...] = (col.INSTANCE_ID, col.REQUEST_ID)
"""Integer id columns: never shown as numbers (instances are named, requests sent as text)."""

PERCENT_WORDS: tuple[str, ...] = ("share", "attainment", "hit_rate", "utilisation", "fluidity", "rel_change",
                                  "relative_error", "reload_ratio", "acceptance_rate", "reuse_fraction")
"""Column names holding a fraction 0..1 (shown as a percentage) contain one of these."""

_LABELS: dict[str, str] = {
    col.TENANT: "tenant", col.SLO_CLASS: "SLO class", col.INSTANCE_ID: INSTANCE, col.REQUEST_ID: "request id",
    col.REQUEST_KEY: "request", col.NUM_WAITING: "waiting", col.NUM_RUNNING: "running",
    col.NUM_PREEMPTED: "preempted", col.NUM_OUTPUT_TOKENS: "output tokens", col.NUM_PROMPT_TOKENS: "prompt tokens",
    col.NUM_CACHED_TOKENS: "cached tokens", col.STATUS: "status",
    "count": "samples", "metric": "metric", "stage": "stage", "t_s": "time (s)", "window_start_s": "window start (s)",
    "ttft_ms": "TTFT (ms)", "tpot_ms": "TPOT (ms)", "itl_ms": "ITL (ms)", "e2e_ms": "end-to-end (ms)",
    "request_rate_rps": "completed (req/s)", "goodput_rps": "goodput (req/s)",
    "attainment_constrained_rate_rps": "highest rate meeting the SLO share (req/s)",
    "arrival_rate_rps": "offered (req/s)",
    "offered_rps": "offered (req/s)", "served_rps": "served (req/s)", "jain_index": "Jain's index",
    "ttft_attainment": "TTFT met (%)", "tpot_attainment": "TPOT met (%)", "attainment": "both met (%)",
    "lookup_hit_rate": "lookup hit rate (%)", "share_of_hit_blocks": "share of hit blocks (%)",
    "p_value": "p-value", "p_adjusted": "p (Holm-adjusted)", "rel_change": "relative change (%)",
    "ci_low": "95% CI low", "ci_high": "95% CI high", "n_baseline": "n baseline", "n_candidate": "n candidate",
    "bytes": "bytes moved", "batch_size_lo": "batch size (from)", "lacks": "lacks (instances)",
    "gb_per_s": "GB/s", "work_per_s": "work (per s)",
    "batch_size_hi": "batch size (to)", "ms_per_token": "amortized per token (ms)",
    "spec_ms_per_token": "speculative, amortized per token (ms)",
    "plain_ms_per_token": "plain, amortized per token (ms)", "mean_carrier_itl_ms": "ITL of a step's first token (ms)",
    "spec_tokens_per_step": "speculative tokens per step", "draft_sources": "draft sources",
}
_UNIT_SUFFIXES: tuple[tuple[str, str], ...] = (
    ("_ms", "ms"), ("_rps", "req/s"), ("_tokens_per_s", "tokens/s"), ("_blocks_per_s", "blocks/s"),
    ("_per_s", "per s"), ("_s", "s"), ("_bytes", "bytes"), ("_ns", "ns"),
)
_ABBREVIATIONS = {"ttft": "TTFT", "itl": "ITL", "tpot": "TPOT", "e2e": "end-to-end", "slo": "SLO", "kv": "KV",
                  "p50": "p50", "num": "", "spec": "speculative"}


def is_percent_column(column: str) -> bool:
    """True for a column whose values are fractions 0..1 (a unit suffix says otherwise: ``attainment_constrained_
    rate_rps`` is a rate)."""
    if any(column.endswith(suffix) and len(column) > len(suffix) for suffix, _ in _UNIT_SUFFIXES):
        return False
    return any(word in column for word in PERCENT_WORDS)


def column_label(column: str) -> str:
    """A column name as a header a person reads, unit included: ``p99_ms`` -> ``p99 (ms)``."""
    if column in _LABELS:
        return _LABELS[column]
    name, unit = column, ""
    if is_percent_column(column):
        unit = "%"
    else:
        for suffix, u in _UNIT_SUFFIXES:
            if name.endswith(suffix) and len(name) > len(suffix):
                name, unit = name[: -len(suffix)], u
                break
    words = [_ABBREVIATIONS.get(w, w) for w in re.split(r"_+", name)]
    text = " ".join(w for w in words if w)
    return f"{text} ({unit})" if unit else text


def instance_label(role: Any, name: Any, fallback: str) -> str:
    """``prefill-0``; ``colocated · engine-0`` when the name does not start with the role; ``fallback``
    when the process has neither."""
    role_label = Role(int(role)).label if role is not None and not pd.isna(role) else ""
    name = "" if name is None or (isinstance(name, float) and pd.isna(name)) else str(name)
    if name and (not role_label or name.startswith(role_label)):
        return name
    if name:
        return f"{role_label} · {name}"
    return f"{role_label} {fallback}".strip() if role_label else fallback


def instance_labels(instances: Any, seen: Iterable[Any] = ()) -> dict[int, str]:
    """Instance id -> a unique name, from an ``instances`` table (Arrow or pandas) or manifest rows.

    Ids that appear in data (``seen``) but not in the table get ``instance 1``, ``instance 2`` ...:
    never the id itself. Two processes with the same name get `` (2)``, `` (3)`` ... appended.
    """
    rows = _instance_rows(instances)
    labels: dict[int, str] = {}
    used: dict[str, int] = {}
    per_role: dict[Any, int] = {}
    for iid, role, name in sorted(rows, key=lambda r: (_role_order(r[1]), str(r[2] or ""), r[0])):
        per_role[role] = per_role.get(role, 0) + 1
        base = instance_label(role, name, str(per_role[role]))
        used[base] = used.get(base, 0) + 1
        labels[iid] = base if used[base] == 1 else f"{base} ({used[base]})"
    unknown = sorted({int(i) for i in seen if i is not None and not pd.isna(i)} - set(labels))
    for k, iid in enumerate(unknown, start=1):
        labels[iid] = f"instance {k}"
    return labels


def _role_order(role: Any) -> int:
    order = [Role.GATEWAY, Role.PREFILL, Role.COLOCATED, Role.DECODE, Role.OTHER, Role.CLIENT]
    try:
        return order.index(Role(int(role)))
    except (TypeError, ValueError):
        return len(order)


def _instance_rows(instances: Any) -> list[tuple[int, Any, Any]]:
    """(id, role value, name) per row of an Arrow table, a DataFrame or manifest dicts; the last row of an id wins."""
    if instances is None:
        return []
    if isinstance(instances, (list, tuple)):  # the manifest's instances: {"instance", "role", "name"}
        out = []
        for i in instances:
            iid = i.get("instance")
            if iid is None:
                continue
            role = i.get("role")
            try:
                role = int(Role.from_label(role)) if isinstance(role, str) else role
            except ValueError:
                role = None
            out.append((int(iid), role, i.get("name")))
        return _last_per_id(out)
    frame = instances.to_pandas() if hasattr(instances, "to_pandas") else instances
    if len(frame) == 0 or col.INSTANCE_ID not in frame:
        return []
    roles = frame[col.ROLE] if col.ROLE in frame else [None] * len(frame)
    names = frame[col.NAME] if col.NAME in frame else [None] * len(frame)
    return _last_per_id([(int(i), r, n) for i, r, n in zip(frame[col.INSTANCE_ID], roles, names)])


def _last_per_id(rows: list[tuple[int, Any, Any]]) -> list[tuple[int, Any, Any]]:
    """A process's instances rows grow (a colocated start, then its role): the last one names it."""
    last: dict[int, tuple[int, Any, Any]] = {}
    for row in rows:
        last[row[0]] = row
    return list(last.values())


def with_instance_names(frame: pd.DataFrame, labels: Mapping[int, str], *, column: str = col.INSTANCE_ID
                        ) -> pd.DataFrame:
    """``frame`` with its instance id column replaced, in place of it, by an ``instance`` column of names."""
    if column not in frame.columns:
        return frame
    names = [labels.get(int(i), "unknown instance") if i is not None and not pd.isna(i) else "-"
             for i in frame[column]]
    out = frame.copy()
    position = list(out.columns).index(column)
    out = out.drop(columns=[column])
    out.insert(position, INSTANCE, names)
    return out


def id_text(value: Any) -> str | None:
    """An integer id as a string (what a browser or JSON reader gets); None stays None."""
    if value is None or (isinstance(value, float) and pd.isna(value)):
        return None
    return str(int(value))


def for_people(frame: pd.DataFrame, labels: Mapping[int, str]) -> pd.DataFrame:
    """``frame`` as a person reads it: instance ids replaced by names, request ids left out when the
    request's own key is there (else kept as text). Column names are unchanged."""
    out = with_instance_names(frame, labels)
    if col.REQUEST_ID in out.columns:
        if col.REQUEST_KEY in out.columns:
            out = out.drop(columns=[col.REQUEST_ID])
        else:
            out = out.assign(**{col.REQUEST_ID: [id_text(v) for v in out[col.REQUEST_ID]]})
    return out
