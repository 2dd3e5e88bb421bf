"""Strings in integer buffers: permanent labels and per-row side strings.

Buffers hold only int64s, so a string column holds an id. Two kinds:

* :class:`Labels` for low-cardinality names (tenant, SLO class, error kind,
  instance name, host): interned once for the recorder's lifetime.
* :class:`SideStrings` for values unique to one row (request key, trace id):
  stored under a fresh id when the row is recorded and removed when the row
  is flushed, so they do not accumulate.

Both are safe to call from any thread: ids come from ``itertools.count``
(GIL-atomic ``next``), and every dict operation used is a single C call.
"""

from __future__ import annotations

import itertools

import numpy as np

__all__ = ["Labels", "SideStrings", "NO_STRING"]

NO_STRING = -1
"""Id decoded as the empty string by both tables."""


class Labels:
    """Interns strings to permanent integer ids; id 0 is the empty string."""

    __slots__ = ("_ids", "_strings", "_next")

    def __init__(self) -> None:
        self._ids: dict[str, int] = {"": 0}
        self._strings: dict[int, str] = {0: "", NO_STRING: ""}
        self._next = itertools.count(1)

    def intern(self, s: str) -> int:
        """Id of ``s`` (any thread). Raises ``TypeError`` if ``s`` is not a str."""
        i = self._ids.get(s)
        if i is not None:
            return i
        if type(s) is not str:
            raise TypeError(f"expected a str, got {type(s).__name__}")
        i = next(self._next)
        self._strings[i] = s  # published before the id can be seen
        # Two threads interning the same new string may both get here; the
        # first id wins and the loser's id still decodes to the same string.
        return self._ids.setdefault(s, i)

    def get(self, i: int) -> str:
        return self._strings.get(i, "")

    def decode(self, ids: np.ndarray) -> list[str]:
        """Strings for an array of ids (flusher); unknown ids decode as ''."""
        get = self._strings.get
        return [get(i, "") for i in ids.tolist()]


class SideStrings:
    """One-shot strings keyed by fresh ids; :meth:`decode` removes them."""

    __slots__ = ("_strings", "_next")

    def __init__(self) -> None:
        self._strings: dict[int, str] = {}
        self._next = itertools.count()

    def put(self, s: str) -> int:
        """Store ``s`` and return its id (any thread); '' costs nothing.

        Raises ``TypeError`` if ``s`` is not a str.
        """
        if type(s) is not str:
            raise TypeError(f"expected a str, got {type(s).__name__}")
        if not s:
            return NO_STRING
        i = next(self._next)
        self._strings[i] = s
        return i

    def discard(self, i: int) -> None:
        """Forget an id whose row was never recorded."""
        self._strings.pop(i, None)

    def decode(self, ids: np.ndarray) -> list[str]:
        """Strings for an array of ids, removing them (flusher only)."""
        pop = self._strings.pop
        return [pop(i, "") for i in ids.tolist()]

    def peek(self, ids: np.ndarray) -> list[str]:
        """Strings for an array of ids, keeping them (the flusher's crash journal)."""
        get = self._strings.get
        return [get(i, "") for i in ids.tolist()]

    def __len__(self) -> int:
        return len(self._strings)
