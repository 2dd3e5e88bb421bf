"""Short explanations of each metric, shown above its chart (definitions: docs/analyzers.md)."""

from __future__ import annotations

__all__ = ["EXPLAIN"]

EXPLAIN: dict[str, str] = {
    "latency": "TTFT: arrival to first token delivered. ITL: time between consecutive tokens. "
               "E2E: arrival to finish. Percentiles over requests (ITL: over tokens), server view.",
    "latency_series": "The same percentiles per time window of arrival, so a bad minute stands out.",
    "slo": "Share of requests of each SLO class that met their TTFT target, their TPOT target, and both.",
    "goodput": "Goodput (DistServe): completed requests that met both SLO targets, per second of run.",
    "counters": "Events the recorder dropped (memory bound) or sampled out: the analyses below miss them.",
    "breakdown": "Share of TTFT and of ITL spent in each stage (shares add up to 1, including unattributed "
                 "time). Mean: over all tokens; tail: over the slowest 1% of tokens.",
    "critical_path": "The stages of the first token in order, with their mean duration, for the median and "
                     "the p99 request: what a slow first token waited on.",
    "explorer": "The slowest {n:,} requests of the run, slowest first (filter and sort them here). Pick one to see its waterfall: each stage as a bar on the "
                "lane of the process that ran it, each token as a tick, the client's view on its own lane.",
    "queues_timeline": "Requests waiting for admission, running and preempted, per engine instance over time.",
    "queue_delay": "Time requests spent in schedule.queue before admission, per SLO class.",
    "littles_law": "Little's law check L = lambda x W: mean requests in the system from the engine's steps "
                   "against arrival rate times mean time in system. A large relative error means lost events.",
    "cache_prefix": "Prefix-cache hit rate by tokens (cached / prompt tokens) and by requests (share with any hit).",
    "cache_tiers": "Lookups that hit in each KV tier and their share of the hit blocks.",
    "cache_churn": "Blocks evicted per second and how many evicted blocks were loaded back (reload ratio).",
    "cache_transfers": "Bytes and time spent swapping, offloading, loading and prefetching KV blocks.",
    "cache_miss_cost": "Mean TTFT of requests with and without a prefix hit, per prompt token: what a miss costs.",
    "pd_utilisation": "Per instance: share of wall time spent in steps with prefill work and with decode work.",
    "pd_watermarks": "Highest and 95th-percentile queue lengths per instance.",
    "pd_kv": "Time spent moving KV blocks from prefill to decode instances, as a share of TTFT and ITL.",
    "pd_recommendation": "Prefill:decode instance ratio the measured workload needs: the prefill (decode) token "
                         "rate required divided by what one instance sustains.",
    "batch": "Decode step time and ITL by batch size: how much each extra sequence in a batch costs.",
    "interference": "For the slowest 1% of decode tokens against median ones: the batch they shared and the "
                    "other requests' prefill tokens in their step.",
    "tenant_latency": "Latency percentiles per tenant.",
    "tenant_shares": "Each tenant's share of requests, tokens and compute time (steps split by token share).",
    "jain": "Jain's fairness index J = (sum x)^2 / (n * sum x^2) of per-tenant shares (weight-normalised): "
            "1 is perfectly fair, 1/n means one tenant took everything.",
    "noisy": "Tenant pairs where one tenant's bursts of arrivals coincide with the other's p99 TTFT rising.",
    "compare": "Candidate against baseline: each metric's change with a bootstrap 95% confidence interval. "
               "Rows in red are significant regressions (the interval excludes 0 and the change is at least 2%).",
}
