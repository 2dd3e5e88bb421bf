"""Process lifecycle of recorders: flush at interpreter exit, start afresh after fork.

Both hooks are installed once, when this module is first imported, and act on
the recorders registered and not yet closed at that moment. Registration holds
a strong reference on purpose: an unclosed recorder is a resource like an open
file, and its buffered events must reach the sink at exit even if nothing else
refers to it any more.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Protocol

__all__ = ["register", "unregister", "live"]

log = logging.getLogger("tokentrace")


class _Lifecycle(Protocol):
    def close(self) -> None: ...

    def _after_fork_in_child(self) -> None: ...


_live: set[_Lifecycle] = set()
_lock = threading.Lock()  # guards _live; never held while calling a recorder


def register(recorder: _Lifecycle) -> None:
    """Close ``recorder`` at exit and reset it in forked children (any thread)."""
    with _lock:
        _live.add(recorder)


def unregister(recorder: _Lifecycle) -> None:
    with _lock:
        _live.discard(recorder)


def live() -> list[_Lifecycle]:
    """Recorders registered and not yet closed."""
    with _lock:
        return list(_live)


def _close_all_at_exit() -> None:
    for r in live():
        try:
            r.close()
        except Exception:
            log.exception("tokentrace: closing a recorder at exit failed")


def _after_fork_in_child() -> None:
    # Runs in the child only, in the thread that called fork(), before any
    # other Python code of the child: the parent's flush threads do not exist
    # here and their locks may be held, so every recorder rebuilds its state
    # (and this module its own lock).
    global _lock
    _lock = threading.Lock()
    for r in list(_live):
        try:
            r._after_fork_in_child()
        except Exception:
            log.exception("tokentrace: resetting a recorder after fork failed")


atexit.register(_close_all_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
