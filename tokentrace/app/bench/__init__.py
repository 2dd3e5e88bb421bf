"""``tokentrace bench``: a load generator for OpenAI-compatible servers that is also
an independent witness of their latency.

It drives a server with synthetic or replayed real-trace workloads (open-loop
arrivals or closed-loop concurrency, tenants and SLO classes), times every
streamed chunk on arrival with ``time.monotonic_ns()``, records its view into a
tokentrace store as instance role ``client``, and prints a summary with the
metric names and definitions of ``vllm bench serve``.

Modules, one responsibility each:

* :mod:`~tokentrace.app.bench.arrivals`: when requests are sent (Poisson, gamma, constant, trace).
* :mod:`~tokentrace.app.bench.synthetic`: synthetic prompt/output length distributions and shared system prompts.
* :mod:`~tokentrace.app.bench.requests`: the values passed between the parts (planned requests, outcomes, failure kinds).
* :mod:`~tokentrace.app.bench.plan`: the list of requests to send (workload x arrivals x tenants x SLO classes).
* :mod:`~tokentrace.app.bench.prefix`: the best prefix-cache hits a server can get on a Mooncake replay.
* :mod:`~tokentrace.app.bench.connections`: HTTP/1.1 keep-alive connections; each network read stamped on arrival.
* :mod:`~tokentrace.app.bench.sse`: one response's SSE events -> token receive times, usage, failures.
* :mod:`~tokentrace.app.bench.client`: one streamed request, its bytes built ahead, failures classified.
* :mod:`~tokentrace.app.bench.dispatch`: sending a list of requests on time on one event loop, bounded.
* :mod:`~tokentrace.app.bench.senders`: the same from several processes, merged into one run.
* :mod:`~tokentrace.app.bench.runner`: a run (in this process or several) and its store records.
* :mod:`~tokentrace.app.bench.progress`: live progress with rich.
* :mod:`~tokentrace.app.bench.summary`: the final summary (``vllm bench serve`` names), text or JSON.
* :mod:`~tokentrace.app.cli.commands.bench`: ``bench_command``, the typer command the CLI registers as ``tokentrace bench``.

Nothing is imported here: each module pulls in only what it needs.
"""
