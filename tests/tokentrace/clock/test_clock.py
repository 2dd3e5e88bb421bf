"""Clock helpers: anchors, NTP-style offsets (synthetic and over a real socket)."""

from __future__ import annotations

import random
import socket
import struct
import threading
import time

import pytest

from tokentrace.clock import (
    Anchor,
    ClockEstimate,
    PingSample,
    estimate_offset,
    now_ns,
    ping_exchange,
    take_anchor,
)


def test_now_ns_is_the_monotonic_clock():
    a = time.monotonic_ns()
    b = now_ns()
    c = time.monotonic_ns()
    assert a <= b <= c


def test_anchor_pairs_monotonic_and_wall_readings_taken_together():
    m0, w0 = time.monotonic_ns(), time.time_ns()
    anchor = take_anchor()
    m1, w1 = time.monotonic_ns(), time.time_ns()
    assert m0 <= anchor.mono_ns <= m1
    assert w0 <= anchor.wall_ns <= w1
    assert anchor.to_wall_ns(anchor.mono_ns + 1_000) == anchor.wall_ns + 1_000
    with pytest.raises(ValueError):
        take_anchor(tries=0)


def test_sample_formulas_follow_the_documented_sign_convention():
    # Remote clock is 1000 ns behind local: t_local = t_remote + 1000.
    # Out delay 30 ns, remote holds it 5 ns, back delay 10 ns.
    t0 = 10_000
    t1 = t0 + 30 - 1000
    t2 = t1 + 5
    t3 = t2 + 1000 + 10
    s = PingSample(t0, t1, t2, t3)
    assert s.rtt_ns == 40
    assert s.offset_ns == 1000 + (10 - 30) // 2  # error = (d_back - d_out) / 2


@pytest.mark.parametrize("seed", range(5))
def test_synthetic_skew_with_asymmetric_delays_is_recovered_within_half_the_rtt(seed):
    rng = random.Random(seed)
    true_offset = rng.randint(-10**12, 10**12)  # t_local = t_remote + true_offset
    samples = []
    t = rng.randint(0, 10**9)
    for _ in range(16):
        d_out = rng.randint(1_000, 500_000)
        d_back = rng.randint(1_000, 500_000)
        hold = rng.randint(0, 50_000)
        t0 = t
        t1 = t0 + d_out - true_offset
        t2 = t1 + hold
        t3 = t2 + true_offset + d_back
        samples.append(PingSample(t0, t1, t2, t3))
        t = t3 + rng.randint(0, 10**6)
    est = estimate_offset(samples)
    best = min(samples, key=lambda s: s.rtt_ns)
    assert est == ClockEstimate(offset_ns=best.offset_ns, rtt_ns=best.rtt_ns, num_samples=16)
    assert abs(est.offset_ns - true_offset) <= est.rtt_ns // 2 + 1


def test_estimate_rejects_empty_and_out_of_order_samples():
    with pytest.raises(ValueError, match="at least one"):
        estimate_offset([])
    with pytest.raises(ValueError, match="negative round trip"):
        estimate_offset([PingSample(100, 0, 0, 50)])
    with pytest.raises(ValueError):
        ping_exchange(lambda t0: (t0, t0), n=0)


def test_real_ping_over_a_socketpair_recovers_a_planted_skew():
    skew_ns = 3_600 * 10**9  # the remote's clock runs one hour ahead of ours
    local, remote = socket.socketpair()

    def serve() -> None:
        while True:
            data = remote.recv(8)
            if len(data) < 8:
                return
            t1 = time.monotonic_ns() + skew_ns
            t2 = time.monotonic_ns() + skew_ns
            remote.sendall(struct.pack("=qq", t1, t2))

    server = threading.Thread(target=serve, daemon=True)
    server.start()

    def send_recv(t0: int) -> tuple[int, int]:
        local.sendall(struct.pack("=q", t0))
        reply = b""
        while len(reply) < 16:
            reply += local.recv(16 - len(reply))
        return struct.unpack("=qq", reply)

    try:
        est = ping_exchange(send_recv, n=16)
    finally:
        local.close()
        server.join(timeout=10)
        remote.close()
    assert est.num_samples == 16
    assert est.rtt_ns > 0
    # t_local = t_remote + offset, and t_remote = t_local + skew.
    assert abs(est.offset_ns + skew_ns) <= est.rtt_ns // 2 + 1


def test_anchor_is_a_frozen_value():
    a = Anchor(mono_ns=1, wall_ns=2)
    with pytest.raises(AttributeError):
        a.mono_ns = 3  # type: ignore[misc]
