"""Request rows: what ``request_begin`` notes and ``request_end`` writes.

A request's row combines facts known at its start (key, tenant, SLO class,
arrival, prompt length, trace id) with facts known at its end, so the start is
kept in a dict of open requests until the end writes one ``requests`` row. The
key and trace id are unique per request, so they go to a side store that the
flush empties (``interning.SideStrings``); tenant, SLO class and error are
interned labels. Not a hot path: one begin and one end per request.
"""

from __future__ import annotations

import itertools

from tokentrace.recorder.buffers import LAYOUTS, TableBuffer
from tokentrace.recorder.interning import NO_STRING, Labels, SideStrings
from tokentrace.schema import NULL_INT, REQUESTS, cap_label, request_id_of

__all__ = ["RequestRows", "OPEN_REQUEST_BYTES"]

_pack_request = LAYOUTS[REQUESTS.name].packer.pack

OPEN_REQUEST_BYTES = 512
"""Accounted bytes of one open request (dict entry, tuple, key and trace strings)."""

# (key, tenant id, SLO class id, arrival ns, prompt tokens, trace id, session id, session turn)
_Begin = tuple[str, int, int, int, int, str, int, int]
_NO_BEGIN: _Begin = ("", 0, 0, NULL_INT, NULL_INT, "", 0, NULL_INT)


class RequestRows:
    """Open requests and the ``requests`` buffer of one recorder.

    Any thread; never raises. Bad arguments bump ``invalid``, begins past
    ``max_open`` bump ``open_drops``, rows past the buffer budget bump the
    buffer's own drop counter (all ``itertools.count``, GIL-atomic).
    """

    __slots__ = ("_buffer", "_labels", "_side", "_open", "_max_open", "_invalid", "_open_drops")

    def __init__(self, buffer: TableBuffer, labels: Labels, side: SideStrings, *, max_open: int,
                 invalid: itertools.count, open_drops: itertools.count) -> None:
        self._buffer = buffer
        self._labels = labels
        self._side = side
        self._open: dict[int, _Begin] = {}
        self._max_open = max_open
        self._invalid = invalid
        self._open_drops = open_drops

    def begin(self, key: str, tenant: str, slo_class: str, arrival_ns: int, num_prompt_tokens: int,
              trace_id: str, session: str = "", session_turn: int = NULL_INT) -> int:
        """Keep the request's start; returns ``request_id_of(key, tenant)`` or ``NULL_INT`` if
        invalid. Key, tenant, SLO class and session are cut to ``MAX_LABEL_CHARS`` (``cap_label``)."""
        try:
            if type(trace_id) is not str or type(key) is not str or type(tenant) is not str:
                raise TypeError("key, tenant and trace_id must be str")
            key, tenant, slo_class, session = cap_label(key), cap_label(tenant), cap_label(slo_class), cap_label(session)
            request_id = request_id_of(key, tenant)
            if type(session_turn) is not int:
                raise TypeError("session_turn must be an int")
            begin = (key, self._labels.intern(tenant), self._labels.intern(slo_class),
                     arrival_ns, num_prompt_tokens, trace_id, self._labels.intern(session), session_turn)
        except Exception:
            next(self._invalid)
            return NULL_INT
        if len(self._open) < self._max_open:
            self._open[request_id] = begin
        else:
            next(self._open_drops)
        return request_id

    def end(self, request_id: int, finish_ns: int, status: int, first_token_ns: int,
            num_output_tokens: int, num_cached_tokens: int, error: str, first_content_ns: int = -1) -> None:
        """Append the request's row (with its start, if one was kept)."""
        try:
            begin = self._open.pop(request_id, None) or _NO_BEGIN
        except Exception:  # unhashable id: pack refuses the row below
            begin = _NO_BEGIN
        key, tenant_id, slo_id, arrival_ns, num_prompt, trace_id, session_id, session_turn = begin
        side = self._side
        key_id = trace_slot = NO_STRING
        try:
            key_id = side.put(key)
            trace_slot = side.put(trace_id)
            row = _pack_request(request_id, key_id, tenant_id, slo_id, arrival_ns, first_token_ns,
                                first_content_ns, finish_ns, num_prompt, num_cached_tokens, num_output_tokens, status,
                                self._labels.intern(error), trace_slot, session_id, session_turn)
        except Exception:
            side.discard(key_id)
            side.discard(trace_slot)
            next(self._invalid)
            return
        b = self._buffer
        try:
            b.reserve()
        except IndexError:  # at the table's budget
            side.discard(key_id)
            side.discard(trace_slot)
            next(b.drops)
            return
        b.put(row)
