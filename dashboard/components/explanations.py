"""Short explanations of each metric, shown above its chart (definitions: docs/analyzers.md)."""

from __future__ import annotations

__all__ = ["EXPLAIN"]

EXPLAIN: dict[str, str] = {
    "load": "Offered load: arrivals per second over the arrival window (first to last arrival, no drain). Served "
            "load: completions per second. Saturated: arrivals outran service (offered at least 10% above served) "
            "with a queue growing, a pool near 100% busy or waiting time growing through the run; the pool named "
            "is the one whose queue grew. Not judged under 10 requests.",
    "latency": "TTFT: arrival to first token delivered. ITL: time between consecutive tokens. "
               "E2E: arrival to finish. Percentiles over requests (ITL: over tokens), server view.",
    "latency_series": "The same percentiles per time window of arrival, so a bad minute stands out.",
    "slo": "Share of requests of each SLO class that met their TTFT target, their TPOT target, and both.",
    "goodput": "Goodput (DistServe): completed requests that met both SLO targets, per second of run. Failed "
               "requests are never good; a target the run did not measure (TPOT without per-token data) is "
               "shown as not measured, never as met.",
    "counters": "Events the recorder dropped (memory bound) or sampled out: the analyses below miss them.",
    "breakdown": "Share of TTFT and of ITL spent in each stage (shares add up to 1, including unattributed "
                 "time). Mean: over all tokens; tail: over the slowest 1% of tokens. Stages under 0.01% in every "
                 "column are named below the charts instead of drawn.",
    "attribution": "Unattributed: token latency minus the stages' time, signed (negative when stages claim more "
                   "than the token's time). Overlap: time two stages both claim. Each should stay under 1%.",
    "critical_path": "The stages of the first token in order, with their mean duration, for the median and "
                     "the p99 request: what a slow first token waited on.",
    "explorer": "The slowest {n:,} requests of the run, the longest time to first token first (filter and sort them here). Pick one to see its waterfall: each stage as a bar on the "
                "lane of the process that ran it, each token as a tick, the client's view on its own lane.",
    "queues_timeline": "Requests waiting for admission, running and preempted, per engine instance over time.",
    "queue_delay": "Time requests spent in schedule.queue before admission, per SLO class.",
    "littles_law": "Little's law check L = lambda x W: mean requests in the system from the engine's steps "
                   "against arrival rate times mean time in system. A large relative error means lost events.",
    "cache_prefix": "Prefix-cache hit rate by tokens (cached / prompt tokens) and by requests (share with any hit).",
    "cache_tiers": "Lookups that hit in each KV tier and their share of the hit blocks.",
    "cache_churn": "Blocks evicted per second and how many evicted blocks were loaded back (reload ratio).",
    "cache_transfers": "Bytes and time spent swapping, offloading, loading and prefetching KV blocks.",
    "cache_hit_value": "What a hit saves, on the stages it changes: cache lookup, cache load and prefill time per "
                       "prompt token, for requests that hit against requests that missed. Queueing is left out: "
                       "it depends on when a request arrived, not on the cache.",
    "cache_hit_rate_time": "Token hit rate per arrival window; the dashed line is the best achievable hit rate "
                           "of the replayed trace (an unbounded cache, from its block hashes) when the run has it.",
    "pd_utilisation": "Per instance: share of wall time spent in steps with prefill work and with decode work.",
    "pd_watermarks": "Highest and 95th-percentile queue lengths per instance.",
    "pd_kv": "Time spent moving KV blocks from prefill to decode instances, as a share of TTFT and ITL.",
    "pd_recommendation": "Whole instances per pool for the offered load (arrivals over the arrival window): the "
                         "prefill (decode) tokens per second it needs over what one instance does per busy second, "
                         "at most 80% busy, and for prefill within the TTFT target (an M/M/1 queue's wait). Decode "
                         "work counts decode tokens only: token 0 is produced by the prefill pass.",
    "batch": "Decode step time and ITL by batch size: how much each extra sequence in a batch costs.",
    "interference": "For the slowest 1% of decode tokens against median ones: the batch they shared and the "
                    "other requests' prefill tokens in their step.",
    "spec": "Speculative decoding: a step proposes k draft tokens (a draft model, n-gram lookup or early-exit "
            "layers) and the target model's verify pass accepts a prefix of them and adds one token of its own. "
            "Acceptance rate: accepted proposals over proposed ones. A step emits the accepted tokens plus one, fewer "
            "when the request ends within it.",
    "spec_position": "Left: of the steps that proposed a token at each draft position, the share whose proposal "
                     "there was accepted (bars), and the same among the steps whose previous proposal was accepted "
                     "(dotted line). Right: how many proposals each verify step accepted.",
    "spec_cost": "Decode compute time (each request's draft, verify and plain decode steps) split into drafting "
                 "whose proposals were accepted, drafting whose proposals were rejected (draft time x rejected / "
                 "proposed), verify passes and plain decode steps. The table adds the verify positions that gave "
                 "no token (k + 1 verified per step, minus the tokens emitted).",
    "spec_itl": "Per batch-size bin, decode tokens of speculative steps against those of plain steps. Bars: the "
                "measured mean ITL (the token that carries a step waits for its draft and verify; the tokens after "
                "it follow at once). Diamonds: the engine step time amortized over the tokens the steps emitted. A "
                "bin is marked slower (red in the table) when the speculative mean ITL is above the plain one by at "
                "least 0.1 ms with a Holm-adjusted p < 0.05 (Welch), both sides holding at least 10 tokens. Below: "
                "speculative against plain overall, then plain tokens beside speculating requests in a mixed batch "
                "(they wait for its draft and longer verify pass) against plain tokens of steps without speculation.",
    "spec_groups": "Acceptance per tenant and per request (the 1,000 requests with the most speculative steps): "
                   "steps, proposals, accepted ones, tokens per step and the draft share of draft and verify time.",
    "session_reuse": "For each turn number, summed over sessions: the prompt tokens whose KV the session's previous "
                     "turn had computed (carried), split into those the prefix cache still served (by tier) and "
                     "those lost during the think time (evicted or dropped by the retention policy) and computed "
                     "again.",
    "session_time": "Each session's time: the sum of its turns' TTFTs, the time spent generating (first token to "
                    "finish) and the think (or tool-call) time between turns.",
    "session_table": "Per session: turns, time, carried, reused and lost tokens, the reuse fraction, the prefill "
                     "time spent recomputing lost tokens (the turn's prefill time x lost / computed prompt tokens) "
                     "and the time loading carried KV from lower tiers.",
    "session_turns": "Every turn: the think time before it, its TTFT and prompt, and its share of cross-turn reuse.",
    "session_fairness": "Per tenant, counted per session and per request: a tenant whose sessions are long can look "
                        "fair per request and slow per session (the sum of a session's TTFTs).",
    "tenant_latency": "Latency percentiles per tenant.",
    "tenant_shares": "Each tenant's share of requests, tokens and compute time (steps split by token share).",
    "jain": "Jain's fairness index J = (sum x)^2 / (n * sum x^2) of per-tenant shares (weight-normalised): "
            "1 is perfectly fair, 1/n means one tenant took everything.",
    "noisy": "Every tenant pair: the victim's TTFT in the aggressor's arrival bursts against the victim's own "
             "trend (a queue slowing everyone is not a neighbour), with sample sizes and a permutation p-value "
             "(Holm-adjusted). Judged with at least 10 windows, 2 bursts and 5 victim requests in them; flagged "
             "(red) at p < 0.05 with at least 5 ms and 10% more TTFT.",
    "capacity_throughput": "Over the run (first arrival to last end): requests completed per second and output tokens "
                           "delivered per second, beside the offered load (arrivals per second over the arrival "
                           "window). Percentiles over requests (ITL: over tokens), server view.",
    "capacity_time": "On one time axis, per window since the first arrival: TTFT percentiles of the requests that "
                     "arrived in the window (dashed: the SLO targets), the requests in flight (arrived, not ended) "
                     "and waiting for their first token (time averages over the window), the engines' own waiting "
                     "queue (steps), and the offered and completed request rates with output tokens per second.",
    "capacity_load": "Each point is one window of this run: its offered load (arrivals per second) against the TTFT "
                     "and ITL percentiles of the requests that arrived in it. Latency that climbs with load shows "
                     "where the server stops keeping up.",
    "capacity_runs": "Each point is one run of the store (the 12 newest): its offered load against its latency "
                     "percentiles; the run shown is ringed.",
    "capacity_prompt": "TTFT percentiles per prompt-length bin (each bin about the same number of requests): the "
                       "cost of a longer prompt before its first token.",
    "capacity_cdf": "Share of requests (ITL: of tokens) at or under each latency. Dashed: the SLO targets (TTFT "
                    "targets on TTFT, TPOT targets on ITL and TPOT).",
    "compare": "Candidate against baseline, each run counted once: a metric's change is judged against how much "
               "it moves between runs of one configuration (noise, the documented figure for one run a side). "
               "Significant: Holm-adjusted p < 0.05 within its family (primary: TTFT, ITL and E2E p50 and p99; "
               "other latency; stages, mean and median per token; context), at least 0.1 ms and 2%; "
               "otherwise 'noise' (not distinguishable from run-to-run noise). min_detectable: the smallest change "
               "this comparison detects with 90% power; runs_needed: runs a side that would detect the change seen. "
               "Regressions vermillion, improvements blue; hit rate, preemptions, utilisation and queue depth beside.",
}
