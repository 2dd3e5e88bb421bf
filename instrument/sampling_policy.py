"""The sampling decision: which requests :class:`~instrument.sampling.SamplingRecorder` keeps.

Pure functions of a request's id and of its times and status; see
``instrument.sampling`` for how they are applied.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokentrace.schema import RequestStatus

__all__ = ["SamplingPolicy"]

_ID_SPACE = 1 << 63  # request ids (schema.request_id_of) are uniform in [0, 2**63)


@dataclass(frozen=True, slots=True)
class SamplingPolicy:
    """What to keep. Thresholds in ns (``None``: no such threshold)."""

    rate: float = 1.0
    """Fraction of requests kept by head sampling, in [0, 1]."""
    slow_ttft_ns: int | None = None
    slow_e2e_ns: int | None = None
    keep_failed: bool = True
    """Keep every request whose status is not ``ok`` (error, aborted, timeout, rejected)."""

    def __post_init__(self) -> None:
        if isinstance(self.rate, bool) or not isinstance(self.rate, (int, float)) or not 0.0 <= self.rate <= 1.0:
            raise ValueError(f"sampling rate must be a number in [0, 1], got {self.rate!r}")
        for name in ("slow_ttft_ns", "slow_e2e_ns"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{name} must be a non-negative int (ns) or None, got {v!r}")

    @property
    def threshold(self) -> int:
        """Head-kept iff ``request_id < threshold``."""
        return _ID_SPACE if self.rate >= 1.0 else int(self.rate * _ID_SPACE)

    @property
    def needs_tail(self) -> bool:
        """Whether requests that are not head-kept must be buffered until their end."""
        return self.keep_failed or self.slow_ttft_ns is not None or self.slow_e2e_ns is not None

    def keeps_end(self, arrival_ns: int, first_token_ns: int, finish_ns: int, status: int) -> bool:
        """Tail decision for a finished request (times on one clock; -1 = unknown)."""
        if self.keep_failed and status != RequestStatus.OK:
            return True
        if arrival_ns < 0:
            return False
        ttft, e2e = self.slow_ttft_ns, self.slow_e2e_ns
        if ttft is not None:
            if first_token_ns >= 0 and first_token_ns - arrival_ns > ttft:
                return True
            if first_token_ns < 0 and finish_ns - arrival_ns > ttft:
                return True
        return e2e is not None and finish_ns - arrival_ns > e2e
