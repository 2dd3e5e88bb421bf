"""The what-if benchmark's contention check (used by ``benchmarks/whatif.py``; not a benchmark of its own).

Is the machine's change of speed between a session's runs the load's own contention (the gateway's event loop
relaying tokens in the engine's process), which the simulator would have to model? Within the fitted run, its
decode steps' measured / modelled time against the load the process carried then; across the base and rate runs,
their slowdown against the offered rate, their place in the session and what the fitted run's own relation gives
at their load (``analyzers.whatif.contention``; docs/whatif.md, "Is the machine's change of speed the load's own
contention?").
"""

from __future__ import annotations

import math
from contextlib import closing
from pathlib import Path

import numpy as np

from analyzers.source import Source
from analyzers.whatif.contention import load_relation, spearman, step_load, step_ratios, within_run_lines
from analyzers.whatif.models import StepTimeModel
from analyzers.whatif.trace import StepRows
from tokentrace.store import open_run


def contention_check(store: Path, configs: dict, steps: dict[str, StepRows], model: StepTimeModel,
                     slow: dict[str, float]) -> None:
    """Is the machine's change of speed the load's own contention? Within base-a, and across the base and rate runs:
    each run's slowdown (``slow``) against its offered rate, place in the session, loop lag and base-a's relation."""
    loads = {}
    for n in configs:
        with closing(Source.of_run(open_run(store, n))) as src:
            loads[n] = step_load(src, steps[n])
    dec = {n: steps[n].num_prefill_tokens == 0 for n in configs}
    print("contention check, within base-a (its decode steps' measured / modelled time against the load then: rank "
          "correlation; median ratio per quartile of the load):")
    for line in within_run_lines(loads["base-a"], steps["base-a"], model):
        print("  " + line)
    slope = load_relation(step_ratios(model, steps["base-a"])[dec["base-a"]],
                          loads["base-a"].relayed_per_s[dec["base-a"]]).slope
    base_load = float(np.median(loads["base-a"].relayed_per_s[dec["base-a"]]))
    runs = [n for n in configs if n.startswith("base-") or n.startswith("rate-")]
    scale = {n: float(n[len("rate-"):]) if n.startswith("rate-") else 1.0 for n in runs}
    lag = {n: float(np.median(loads[n].loop_lag_share[dec[n]])) for n in runs}
    print("  across runs (session order): slowdown measured / given by base-a's relation at the run's median relayed "
          "tokens per s; loop-lag share: " + ", ".join(
              f"{n} {slow[n]:.2f}/{math.exp(slope * (np.median(loads[n].relayed_per_s[dec[n]]) - base_load)):.2f} "
              f"{lag[n]:.2f}" for n in runs))
    order = {n: i for i, n in enumerate(configs)}
    x = [slow[n] for n in runs]
    print(f"  slowdown's rank correlation over these {len(runs)} runs: with the offered rate "
          f"{spearman(x, [scale[n] for n in runs]):+.2f}, with the place in the session "
          f"{spearman(x, [order[n] for n in runs]):+.2f}, with the loop-lag share {spearman(x, [lag[n] for n in runs]):+.2f}; "
          f"runs of the base configuration (the same load): {min(slow[n] for n in runs if scale[n] == 1.0):.2f}-"
          f"{max(slow[n] for n in runs if scale[n] == 1.0):.2f}")
