"""Polling for state that another thread or process changes (a server's, an engine's), never a fixed sleep."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], bool], *, timeout_s: float = 10.0) -> bool:
    """Poll ``predicate`` until true or ``timeout_s`` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()
