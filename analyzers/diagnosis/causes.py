"""The causes a diagnosis names, the setting that changes each, and the rows a rule returns.

Every cause has a name (the JSON ``cause``), a one-line fix naming the setting that would
change it (empty where no setting does), and is detected by one documented rule
(``docs/diagnosis.md``). A rule returns :class:`Finding` values: the cause, the milliseconds of
the request's (or token gap's) time it explains, the evidence in words and, where they apply,
the stage, the tenant and the other requests it names.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OVERLOAD", "BURST", "HEAD_OF_LINE", "PREFIX_MISS", "PREEMPTION", "KV_TRANSFER", "BATCH_INTERFERENCE",
           "NOISY_NEIGHBOUR", "SLOW_STAGE", "EVENT_LOOP_LAG", "GIL_CONTENTION", "CPU_STARVED", "SPECULATION",
           "OUTSIDE_SERVER", "LONG_PREFILL", "COSCHEDULED_PREFILL", "ENGINE_STALL", "UNKNOWN", "CAUSES", "FIXES", "Finding"]

OVERLOAD = "overload"
BURST = "burst"
HEAD_OF_LINE = "head_of_line"
PREFIX_MISS = "prefix_miss"
PREEMPTION = "preemption"
KV_TRANSFER = "kv_transfer"
BATCH_INTERFERENCE = "batch_interference"
NOISY_NEIGHBOUR = "noisy_neighbour"
SLOW_STAGE = "slow_stage"
EVENT_LOOP_LAG = "event_loop_lag"
GIL_CONTENTION = "gil_contention"
CPU_STARVED = "cpu_starved"
SPECULATION = "speculation"
OUTSIDE_SERVER = "outside_server"
LONG_PREFILL = "long_prefill"
COSCHEDULED_PREFILL = "coscheduled_prefill"
ENGINE_STALL = "engine_stall"
UNKNOWN = "unknown"

CAUSES: tuple[str, ...] = (OVERLOAD, BURST, HEAD_OF_LINE, PREFIX_MISS, PREEMPTION, KV_TRANSFER, BATCH_INTERFERENCE,
                           NOISY_NEIGHBOUR, SLOW_STAGE, EVENT_LOOP_LAG, GIL_CONTENTION, CPU_STARVED, SPECULATION,
                           OUTSIDE_SERVER, LONG_PREFILL, COSCHEDULED_PREFILL, ENGINE_STALL, UNKNOWN)
"""Every cause name, in the order docs/diagnosis.md documents them."""

FIXES: dict[str, str] = {
    OVERLOAD: "add instances to the saturated pool, or admit less (rate limits, load shedding)",
    BURST: "absorb bursts: spare capacity or autoscaling ahead of them, admission control, or smoother arrivals",
    HEAD_OF_LINE: "chunked prefill with a smaller batched-token budget (--max-num-batched-tokens), or a priority "
                  "or deadline-aware scheduling policy (--scheduling-policy slo)",
    PREFIX_MISS: "a larger prefix cache (--num-device-blocks), a lower cache tier (--num-host-blocks, "
                 "--num-disk-blocks) or a retention policy that keeps shared prefixes (--kv-retention)",
    PREEMPTION: "more KV blocks (--num-device-blocks), fewer concurrent sequences (--max-num-seqs), or swap "
                "instead of recompute (--preemption-mode swap)",
    KV_TRANSFER: "where the decode worker's receiving holds the time, a faster prefill-to-decode link or larger "
                 "transfer chunks (--kv-chunk-blocks); where the prefill worker's sending does, a less loaded prefill "
                 "worker (more prefill instances); or colocated serving for short prompts",
    BATCH_INTERFERENCE: "a smaller batched-token budget so prefill chunks slow decode steps less "
                        "(--max-num-batched-tokens), fewer sequences per step (--max-num-seqs), or disaggregated "
                        "prefill",
    NOISY_NEIGHBOUR: "per-tenant rate limits or quotas, or fair scheduling (--scheduling-policy fair)",
    SLOW_STAGE: "make the named stage faster: it is slow for every request, not by queueing",
    EVENT_LOOP_LAG: "move blocking work off the serving event loop (or add gateway processes)",
    GIL_CONTENTION: "run the engine in a process of its own (disaggregated workers, or an engine worker process "
                    "beside the gateway), or cut the engine's Python time per step",
    CPU_STARVED: "give the serving processes CPU: fewer processes per core, a bigger machine, or CPU pinning; the "
                 "server's code is not the cause",
    SPECULATION: "fewer speculative tokens (--num-speculative-tokens) or a speculative budget "
                 "(--speculative-budget), or a better-matched draft",
    OUTSIDE_SERVER: "look outside the server: the network, a proxy or the client itself",
    LONG_PREFILL: "a long prompt's own prefill: faster prefill per request (a faster or tensor-parallel prefill "
                  "instance, prefix caching of its prompt), or a TTFT target that grows with the prompt",
    COSCHEDULED_PREFILL: "a smaller batched-token budget (--max-num-batched-tokens with chunked prefill) so a step "
                         "computes fewer other prompts' tokens ahead of a request's first token, or long prompts kept "
                         "apart from short ones (a prefill pool of their own, or a priority for short prompts)",
    ENGINE_STALL: "give the engine's process the CPU it needs: fewer processes per core, no CPU quota that throttles "
                  "it (a container's cpu limit), dedicated cores; or find what blocks its thread between steps (a "
                  "garbage-collection pause, a synchronous call)",
    UNKNOWN: "",
}
"""The setting that changes each cause ('' where none does)."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One cause of one request's (or token gap's) time over target.

    ``ms``: the time it explains before scaling to the excess; ``requests``: other requests' keys
    it names (with their prompt lengths in ``evidence``).
    """

    cause: str
    ms: float
    evidence: str
    stage: str = ""
    tenant: str = ""
    requests: tuple[str, ...] = ()
