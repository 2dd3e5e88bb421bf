"""Benchmark: precision and recall of the diagnosis's first cause on planted-fault runs of the reference server.

Builds every planted run of ``tests/planted_runs.py`` (each kind, colocated and disaggregated: a few seconds
of load each against the real stack, tiny model, CPU) into a temporary store, diagnoses each with the targets
``tests/analyzers/test_diagnosis_planted.py`` uses (ones the planted fault breaks), and prints per run: the
requests judged and missed, the requests the fault hit that missed (truth from the client and the raw store),
the requests given the planted cause first, recall (of the hit and missed, the share given the planted cause
first) and precision (of those given it, the share the fault hit), the first causes seen, and the first causes
of the hit and missed requests not given the planted one (what recall lost to). Requests the truth calls
unsure (touched by the fault too little to call) count in neither figure. Says what machine it ran on.
Run: ``.venv/bin/python benchmarks/diagnosis_accuracy.py`` (5-10 minutes on 2 busy cores);
``--kinds head_of_line,overload`` for some kinds only, ``--repeat N`` for N runs of each.
The last line is ``planted_kinds_at_bar=<kinds whose recall and precision both reach 0.9 in every run and mode>/<kinds>``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[0:1] = [str(REPO)]  # the repository, not this folder (its analyzers.py would shadow the package)
sys.path += [str(REPO / "tests"), str(REPO / "tests" / "analyzers")]  # after the packages: tests/analyzers is no package

from planted_runs import SCENARIOS, build_run  # noqa: E402
from test_diagnosis_planted import BAR, TARGETS  # noqa: E402

import tokentrace  # noqa: E402
from tokentrace.schema import col  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kinds", default="", help="comma-separated planted kinds (default: every kind)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each kind and mode (default: 1)")
    args = parser.parse_args()
    kinds = [k for k in SCENARIOS if k != "none"]
    if args.kinds:
        unknown = set(args.kinds.split(",")) - set(kinds)
        if unknown:
            parser.error(f"unknown kinds {sorted(unknown)}; kinds: {', '.join(kinds)}")
        kinds = [k for k in kinds if k in args.kinds.split(",")]
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}")
    at_bar: dict[str, bool] = {}
    for _ in range(max(args.repeat, 1)):
        for kind in kinds:
            for mode in SCENARIOS[kind].modes:
                with tempfile.TemporaryDirectory() as tmp:
                    _measure(Path(tmp), kind, mode, at_bar)
    print(f"planted_kinds_at_bar={sum(at_bar.values())}/{len(at_bar)}")


def _measure(tmp: Path, kind: str, mode: str, at_bar: dict[str, bool]) -> None:
    """Build one planted run into ``tmp``, print its figures, and mark whether its kind is at the bar."""
    run = build_run(tmp, kind, mode)
    t = TARGETS[kind]
    d = tokentrace.open(run.store, run.run).analyze().diagnosis(
        ttft_ms=t.ttft_ms, itl_ms=t.itl_ms, e2e_ms=t.e2e_ms)
    first = dict(zip(d.requests[col.REQUEST_KEY], d.requests["first_cause"]))
    hit_missed = run.hit & set(first)
    given = {k for k, c in first.items() if c == run.cause} - run.unsure
    recall = len(given & hit_missed) / len(hit_missed) if hit_missed else float("nan")
    precision = len(given & run.hit) / len(given) if given else float("nan")
    ok = recall >= BAR and (precision >= BAR or not given)
    at_bar[kind] = at_bar.get(kind, True) and ok
    print(f"{kind:16s} {mode:9s} judged={d.num_judged:3d} missed={d.num_missed:3d} "
          f"hit&missed={len(hit_missed):3d} given={len(given):3d} recall={recall:.2f} "
          f"precision={precision:.2f} first causes={dict(Counter(first.values()))} "
          f"lost to={dict(Counter(first[k] for k in hit_missed - given))} unsure={len(run.unsure)} "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
