"""Which server request each client record is: by request id, else by send time and order.

Every time here is on the run's reference clock (ns). A record whose tool sent an id the
server recorded (AIPerf's ``X-Request-ID``, kept by the reference gateway and the ASGI
middleware as ``requests.request_key``) is that request. The others (tools that send no id
or do not save it, ids the server did not keep) are matched in send order: each takes the
earliest-arriving server request not matched yet whose arrival lies within
``[send - slack_ns, send + window_ns]``. The slack allows for the error of putting the
client's clock on the reference clock; the window bounds how long a request may take to
reach the server (connection set-up, a busy accept loop).
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass
from typing import Mapping, Sequence

__all__ = ["MatchKind", "Match", "match_records", "SLACK_NS", "WINDOW_NS"]

SLACK_NS = 5_000_000  # 5 ms: a server arrival may read this much before the client's send
WINDOW_NS = 10_000_000_000  # 10 s: the latest a request may reach the server after its send


class MatchKind(enum.Enum):
    ID = "id"
    TIME = "time"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class Match:
    server_key: str  # empty when unmatched
    kind: MatchKind


def match_records(sends: Sequence[tuple[str, int]], server: Mapping[str, int], *,
                  slack_ns: int = SLACK_NS, window_ns: int = WINDOW_NS) -> list[Match]:
    """One :class:`Match` per client record.

    ``sends``: (key the tool sent or "", send time) per record, in the file's order;
    ``server``: server request key -> its arrival.
    """
    out: list[Match | None] = [None] * len(sends)
    taken: set[str] = set()
    for i, (key, _) in enumerate(sends):
        if key and key in server and key not in taken:
            out[i] = Match(key, MatchKind.ID)
            taken.add(key)
    free = sorted((t, k) for k, t in server.items() if k not in taken)
    arrivals = [t for t, _ in free]
    used = [False] * len(free)
    for i in sorted((i for i in range(len(sends)) if out[i] is None), key=lambda i: sends[i][1]):
        send = sends[i][1]
        j = bisect.bisect_left(arrivals, send - slack_ns)
        while j < len(free) and used[j]:
            j += 1
        if j < len(free) and arrivals[j] <= send + window_ns:
            used[j] = True
            out[i] = Match(free[j][1], MatchKind.TIME)
        else:
            out[i] = Match("", MatchKind.NONE)
    return [m for m in out if m is not None]
