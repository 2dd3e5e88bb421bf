"""What-if accuracy: predictions from one run against real runs of the changed configurations.

One reference server (``python -m reference_server --mode local``, one engine in the gateway's process,
``--model small`` by default) is traced under ``tokentrace run`` and loaded by ``tokentrace bench``
(synthetic prompts of 32-256 tokens, outputs of 8-48, Poisson arrivals, the same seed every run). Runs, all
in this session, in this order:

* ``base-a`` (first) and ``base-b`` (last): the same configuration twice, at both ends of the session.
  Their difference is the run-to-run noise of this machine over the session, per metric:
  ``|a - b| / mean(a, b)``. The load average before each run is printed beside it.
* ``rate-0.5``, ``rate-1.5``: the request rate halved and raised by half;
* ``seqs``: ``--max-num-seqs`` 4; ``budget``: ``--max-num-batched-tokens`` 64;
* ``rate-0.75``, ``rate-2.0``, ``rate-2.5``, ``rate-3.0``: with 0.5, 1 and 1.5, the measured SLO sweep's first
  pass (``--sweep`` sets its rate scales); then a second pass of every rate but 1x in the reverse order
  (``p2-rate-3.0`` .. ``p2-rate-0.5``; ``--passes``), so that each rate is measured at two places in the session;
* ``p2-budget``, ``p2-seqs``: the other two changes again (with one pass, not run), so that each of the four
  changes is run twice.

The simulator is fitted to ``base-a`` only (``analyzers.whatif.fit_whatif``), and predicts each other
configuration; each prediction is compared with its real run: error = ``|predicted - real| / real``, for
TTFT, ITL and E2E p50 and p99, beside the noise. A prediction meets the bar when its error is within
``max(15%, 1.5 x noise)``. The SLO-breaking rate: where the share of requests meeting their targets
falls below 90% over the sweep's rate scales (0.5-3 by default; linearly interpolated between the two scales
around it), predicted (a simulator sweep) and measured: a rate's share pooled over its runs in every pass, 1x's
over every base run (``whatif_sweep.py``). The targets (``--slo auto``, the default) are base-a's own TTFT and
TPOT p99: what base-a meets, so that the break is where more load breaks it, whatever this machine's speed that
day; ``--slo p90`` (base-a's p90, which base-a itself meets for only about 80% of its requests, so that the break
lies below 1x where the curve is flattest) or ``--slo ttft=2s,tpot=200ms`` set them otherwise.

The machine's drift: each run's slowdown against base-a on like steps (the median over batch sizes of its
decode-only steps' median time against base-a's: how much the machine's speed changed between the runs,
whatever any model says; not measured when the two runs share fewer than 20 such steps). Every prediction is
made twice: raw, and drift-corrected, with ``step_time_scale`` set to that slowdown (every step and busy gap
that much slower or faster): the corrected error leaves out the machine's change of speed as far as like
steps measure it, the raw one holds both it and the simulator's own error. Both are printed beside the noise,
each with its count within the bar and within 15% alone, and their medians (a prediction whose drift was
not measured counts as missed in the corrected count).

Also printed: per run, the step-time forms' error on held-out steps and the form chosen; within each run,
the step time of its decode steps of at most 4 sequences predicted by a fit on its steps of more than 4, per
form (and an absolute least-squares line), which the machine's change of speed between runs does not enter;
and, for a prediction whose replayed batches leave the batch sizes base-a covered, its stated range and note.

The SLO sweep's drift-corrected curve uses, per rate, the median of its runs' slowdowns (for a run with too few
like steps, its decode steps' median measured / modelled time by base-a's model over base-a's own); the measured break's noise: the break with each
pass alone, and with each rate's pooled requests resampled (or one request's verdict changed: 60 requests move
a share by 1.7 points); the predicted break of each replay alone (timeline phase; a prediction averages them) and
on a finer grid of rate scales. The contention check: within base-a, its decode steps' measured / modelled
time against the load the process carried then (streams in flight, tokens relayed per second, event-loop lag;
``analyzers.whatif.contention``), and across the base and rate runs, their slowdown against the offered rate, their
place in the session and what base-a's own relation gives at their load (``whatif_contention.py``). The four
changes, each run twice (``whatif_reruns.py``): each one's own run-to-run noise; its second run taken as the
prediction of its first, held to the simulator's bar (what a rerun of the configuration, the best prediction
there is, scores on this machine, beside what the simulator scores); and the simulator against the mean of the
two runs (the tally stays the first runs against base-a/base-b's noise).

Last line: ``whatif_median_error=<median of every raw prediction's error over the six latency metrics>``
(the drift-corrected median is the line before it).

``--paired`` also runs the base configuration after each of the four changes (base-1 .. base-4) and
prints a second table: each change predicted from the base run just before it (raw and corrected by the
change's drift against that base run), its bar from the noise between that base run and the next.

``--device-delay SPEC`` passes the server a ``--delay`` spec (``decode_step=20ms,prefill_token=1ms``, with
``--model tiny``): every engine step then sleeps a device's time that the host's speed does not change, and the
model's own CPU time is a small part of each step, as an accelerator's steady step time would make it.

Run: ``.venv/bin/python benchmarks/whatif.py [--requests 30] [--rate 2.0] [--model small] [--paired]``
(about 8 minutes on 2 quiet CPU cores; about 9 with ``--paired``). ``--store DIR --reuse`` analyses the runs already
in DIR instead of running them (a run not there is left out, and said so).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from whatif_contention import contention_check  # noqa: E402
from whatif_reruns import CHANGES, RerunTally, later_changes, rel, second_run, spread  # noqa: E402
from whatif_sweep import (  # noqa: E402
    DEFAULT_SCALES,
    MeasuredSweep,
    break_noise,
    breaks_line,
    later_passes,
    rate_run,
    runs_by_scale,
)

from analyzers.latency import latency  # noqa: E402
from analyzers.slo import SloTargets  # noqa: E402
from analyzers.source import Source  # noqa: E402
from analyzers.whatif import fit_whatif  # noqa: E402
from analyzers.whatif.metrics import measured_metrics  # noqa: E402
from analyzers.whatif.models import STEP_FORMS, StepTimeModel, nonnegative_lstsq, step_features  # noqa: E402
from analyzers.whatif.predict import crossing  # noqa: E402
from analyzers.whatif.trace import StepRows, read_trace  # noqa: E402
from tokentrace.app.demo.server import ServerSpec, TracedServer  # noqa: E402
from tokentrace.store import open_run  # noqa: E402

METRICS = ("ttft.p50", "ttft.p99", "itl.p50", "itl.p99", "e2e.p50", "e2e.p99")
BAR_FLOOR = 0.15
NOISE_FACTOR = 1.5
TARGET_SHARE = 0.9
MIN_LIKE_STEPS = 20  # like steps (decode-only, same batch size, counted on the smaller side) to measure a drift


def server_command(store: Path, run_id: str, model: str, extra: list[str]) -> list[str]:
    server = [sys.executable, "-m", "reference_server", "--mode", "local", "--port", "0", "--model", model,
              "--device", "cpu", *extra]
    return [sys.executable, "-m", "tokentrace.app.cli", "run", "--store", str(store), "--run", run_id, "--", *server]


def one_run(store: Path, run_id: str, args: argparse.Namespace, *, rate: float, extra: list[str]) -> None:
    """Serve and load one configuration into run ``run_id``."""
    spec = ServerSpec(store=store, run_id=run_id, tenants_file=store / "none.toml")
    env_threads = os.environ.setdefault("OMP_NUM_THREADS", "1")
    server = TracedServer(spec, log_path=store / f"{run_id}.log",
                          command=server_command(store, run_id, args.model,
                                                 [*extra, *(["--delay", args.device_delay] if args.device_delay else [])]))
    try:
        url = server.start(timeout_s=180)
        bench = [sys.executable, "-m", "tokentrace.app.cli", "bench", "--url", url, "--store", str(store), "--run", run_id,
                 "--rate", str(rate), "--max-requests", str(args.requests), "--input-len", "uniform:32-256",
                 "--output-len", "uniform:8-48", "--seed", str(args.seed), "--timeout", "120"]
        subprocess.run(bench, cwd=REPO, check=True, stdout=subprocess.DEVNULL, timeout=600)
    finally:
        server.stop(grace_s=30)
    del env_threads


def measured(store: Path, run_id: str, targets: dict[str, SloTargets]) -> dict[str, float]:
    src = Source.of_run(open_run(store, run_id))
    try:
        return measured_metrics(src, targets)
    finally:
        src.close()


def slo_targets(store: Path, spec: str) -> dict[str, SloTargets]:
    """``auto`` (= ``p99``): base-a's TTFT and TPOT p99 for every class; ``p90``: their p90; else
    ``ttft=..ms,tpot=..ms``."""
    if spec in ("auto", "p99", "p90"):
        pct = "p90" if spec == "p90" else "p99"
        src = Source.of_run(open_run(store, "base-a"))
        lat = latency(src).set_index("metric")
        src.close()
        return {"*": SloTargets(float(lat.loc["ttft", f"{pct}_ms"]), float(lat.loc["tpot", f"{pct}_ms"]))}
    parts = dict(p.split("=") for p in spec.split(","))
    ms = {k: float(v[:-2]) if v.endswith("ms") else float(v.rstrip("s")) * 1000 for k, v in parts.items()}
    return {"*": SloTargets(ms["ttft"], ms["tpot"])}


def decode_steps(s: StepRows) -> dict[int, tuple[float, int]]:
    """Median duration (ns) and count of a run's decode-only engine steps per batch size (sequences), for batch
    sizes with at least three such steps."""
    out = {}
    for n in np.unique(s.num_seqs):
        mask = (s.num_seqs == n) & (s.num_prefill_tokens == 0)
        if mask.sum() >= 3:
            out[int(n)] = (float(np.median(s.duration_ns[mask])), int(mask.sum()))
    return out


def slowdown(run: dict[int, tuple[float, int]], base: dict[int, tuple[float, int]]) -> float:
    """Median over the batch sizes both runs have of (run's median decode step / base's): how much slower the
    machine ran one run than the other, measured on like steps, whatever any model says; NaN when the two runs
    have fewer than :data:`MIN_LIKE_STEPS` like steps (a run of other batch sizes: too few to say)."""
    common = sorted(set(run) & set(base))
    if sum(min(run[n][1], base[n][1]) for n in common) < MIN_LIKE_STEPS:
        return math.nan
    return float(np.median([run[n][0] / base[n][0] for n in common]))


def model_slowdown(run: StepRows, base: StepRows, model: StepTimeModel) -> float:
    """Median measured / modelled time of a run's decode-only steps over base-a's own (``model``: fitted on base-a):
    the machine's change of speed where too few like steps measure it; the model's error on batch sizes base-a
    did not run enters it, so it serves only the sweep's rate runs, whose batches are like base-a's."""
    def median_ratio(s: StepRows) -> float:
        sel = s.num_prefill_tokens == 0
        pred = model.features(s.num_prefill_tokens[sel], s.num_decode_tokens[sel], s.num_seqs[sel],
                              s.decode_context[sel]) @ np.asarray(model.coefficients)
        return float(np.median(s.duration_ns[sel] / pred)) if sel.any() else math.nan
    return median_ratio(run) / median_ratio(base)


def like_steps(run: dict[int, tuple[float, int]], base: dict[int, tuple[float, int]]) -> int:
    return sum(min(run[n][1], base[n][1]) for n in set(run) & set(base))


def run_steps(store: Path, run_id: str) -> StepRows:
    src = Source.of_run(open_run(store, run_id))
    try:
        return read_trace(src).steps
    finally:
        src.close()


def small_batch_extrapolation(s: StepRows, seqs: int) -> tuple[dict[str, float], int]:
    """Within one run: step-time models fitted on its steps of more than ``seqs`` sequences, against its decode
    steps of at most ``seqs`` (median predicted / measured), per form (:data:`STEP_FORMS`, relative fit, and the
    form the held-out comparison chooses on those steps) and for a linear absolute least-squares fit; and how
    many such steps there were. Both sides of the comparison ran at the same time, so the machine's change of
    speed between runs does not enter it."""
    train, test = s.num_seqs > seqs, (s.num_seqs <= seqs) & (s.num_prefill_tokens == 0)
    if train.sum() < 10 or test.sum() < 5:
        return {}, int(test.sum())
    y = s.duration_ns[test]
    out = {}
    for form in (*STEP_FORMS, None):
        m = StepTimeModel.fit(s, train, form)
        pred = m.features(s.num_prefill_tokens[test], s.num_decode_tokens[test], s.num_seqs[test],
                          s.decode_context[test]) @ np.asarray(m.coefficients)
        out[f"chosen ({m.form})" if form is None else form] = float(np.median(pred / y))
    x = step_features(s.num_prefill_tokens, s.num_decode_tokens, s.num_seqs, s.decode_context)
    out["linear absolute"] = float(np.median(x[test] @ nonnegative_lstsq(x[train], s.duration_ns[train]) / y))
    return out, int(test.sum())


def heldout_line(s: StepRows) -> str:
    """The step-time forms' held-out errors on one run's steps, and the one chosen."""
    m = StepTimeModel.fit(s, np.ones(s.num_seqs.size, dtype=bool))
    return ", ".join(f"{f} {100 * e:.1f}%" for f, e in m.heldout) + f" -> {m.form}"


class Tally:
    """Errors of raw and drift-corrected predictions, and how many meet the bar and the 15% floor."""

    def __init__(self) -> None:
        self.raw: list[float] = []
        self.corrected: list[float] = []
        self.met = {"raw": 0, "corrected": 0, "raw 15%": 0, "corrected 15%": 0}
        self.total = 0

    def add(self, raw: float, corrected: float, bar: float, counted: bool) -> tuple[bool, bool]:
        self.raw.append(raw)
        self.corrected.append(corrected)
        ok = (math.isfinite(raw) and raw <= bar, math.isfinite(corrected) and corrected <= bar)
        if counted:
            self.total += 1
            for key, err, within in (("raw", raw, ok[0]), ("corrected", corrected, ok[1])):
                self.met[key] += within
                self.met[f"{key} 15%"] += math.isfinite(err) and err <= BAR_FLOOR
        return ok

    def summary(self, what: str) -> str:
        return (f"{what}: raw {self.met['raw']}/{self.total}, drift-corrected {self.met['corrected']}/{self.total} "
                f"metrics within max({100 * BAR_FLOOR:.0f}%, {NOISE_FACTOR}x noise); within {100 * BAR_FLOOR:.0f}% "
                f"alone: raw {self.met['raw 15%']}/{self.total}, drift-corrected {self.met['corrected 15%']}/{self.total}; "
                f"median error raw {median(self.raw):.3f}, drift-corrected {median(self.corrected):.3f}")


def bar_of(noise: float) -> float:
    """A prediction's bar from the run-to-run noise of its metric: max(15%, 1.5x noise) (15% where not measured)."""
    return max(BAR_FLOOR, NOISE_FACTOR * noise) if math.isfinite(noise) else BAR_FLOOR


def median(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return float(np.median(finite)) if finite else math.nan


def compare(model, name: str, settings: dict, real: dict[str, float], drift: float, noise: dict[str, float],
            tally: Tally, counted: bool, fitted_on: str) -> dict[str, float]:
    """One change: the raw prediction and the one on a device ``drift`` times as slow (the machine's measured
    change of speed), each against the real run, beside the bar from ``noise``; the raw prediction's metrics."""
    prediction = model.predict(settings, in_place=False)  # another run: its slow periods at other moments
    pred = prediction.metrics
    corrected = (model.predict({**settings, "step_time_scale": drift}, ranges=False).metrics
                 if math.isfinite(drift) else {m: math.nan for m in METRICS})
    for m in METRICS:
        err, cerr = rel(pred[m], real[m]), rel(corrected[m], real[m])
        bar = bar_of(noise[m])
        ok, cok = tally.add(err, cerr, bar, counted)
        span = prediction.ranges.get(m)
        inside = "" if span is None else (f"  {span[0]:.1f}-{span[1]:.1f} (real "
                                          f"{'inside' if span[0] <= real[m] <= span[1] else 'outside'})")
        print(f"{name:<10} {fitted_on:<9} {m:<9} {pred[m]:>10.1f} {real[m]:>10.1f} {100 * err:>6.0f}% {drift:>6.2f} "
              f"{corrected[m]:>10.1f} {100 * cerr:>6.0f}% {100 * bar:>5.0f}%  {'yes' if ok else 'no ':<3} "
              f"{'yes' if cok else 'no'}{inside}")
    for note in prediction.notes:
        print(f"  note ({name}): {note}")
    return pred


HEADER = (f"{'config':<10} {'fitted on':<9} {'metric':<9} {'predicted':>10} {'real':>10} {'error':>7} {'drift':>6} "
          f"{'corrected':>10} {'error':>7} {'bar':>6}  ok (raw, corrected)  range (extrapolated predictions)")


def paired(store: Path, configs: dict, real: dict[str, dict[str, float]], targets: dict[str, SloTargets],
           like: dict[str, dict[int, float]]) -> Tally:
    """``--paired``: each change predicted from the base run just before it, raw and scaled by the machine's
    drift (the change's like steps against that base run's), its bar from the noise between that base run
    and the one just after it."""
    order = list(configs)
    bases = [i for i, n in enumerate(order) if n.startswith("base-")]
    tally = Tally()
    print("paired: each change predicted from the base run just before it; drift: the change's like steps against "
          "that base run's; noise: that base run against the next (their drift in brackets)")
    print(HEADER)
    for i, name in enumerate(order):
        if name.startswith("base-") or name not in CHANGES:
            continue
        before = order[max(b for b in bases if b < i)]
        after = order[min(b for b in bases if b > i)]
        src = Source.of_run(open_run(store, before))
        try:
            model = fit_whatif(src, targets=targets)
        finally:
            src.close()
        noise = {m: spread(real[before][m], real[after][m]) for m in METRICS}
        print(f"  ({before} -> {after}: drift {slowdown(like[after], like[before]):.2f}; fitted step form "
              f"{model.models.all_steps.form})")
        compare(model, name, configs[name][2], real[name], slowdown(like[name], like[before]), noise, tally, True,
                before)
    print(tally.summary("paired"))
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--rate", type=float, default=2.0, help="base request rate, req/s")
    parser.add_argument("--model", default="small")
    parser.add_argument("--device-delay", default="",
                        help="the server's --delay spec for a device of steady speed, e.g. "
                             "decode_step=20ms,prefill_token=1ms (sleeps the host's speed does not change)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--slo", default="auto",
                        help="auto or p99 (base-a's TTFT and TPOT p99), p90 (their p90), or ttft=2000ms,tpot=200ms")
    parser.add_argument("--sweep", default=",".join(f"{s:g}" for s in DEFAULT_SCALES),
                        help="rate scales of the measured SLO sweep (1 and the four changes' 0.5 and 1.5 among them)")
    parser.add_argument("--passes", type=int, default=2,
                        help="passes of the measured sweep (each in the reverse order of the one before)")
    parser.add_argument("--store", default="", help="keep the runs in this store (default: a temporary folder)")
    parser.add_argument("--reuse", action="store_true", help="analyse the runs already in --store")
    parser.add_argument("--paired", action="store_true",
                        help="also run the base configuration between the changed ones, and predict each change "
                             "from the base run just before it (a second table)")
    args = parser.parse_args()
    scales = tuple(sorted({float(v) for v in args.sweep.split(",")} | {0.5, 1.0, 1.5}))
    print(f"machine: {platform.platform()}, {os.cpu_count()} CPUs, python {platform.python_version()}; "
          f"model {args.model}, {args.requests} requests per run, base rate {args.rate} req/s, slo {args.slo}"
          + (f", device delay {args.device_delay}" if args.device_delay else ""))
    with tempfile.TemporaryDirectory(prefix="whatif-bench-") as tmp:
        store = Path(args.store) if args.store else Path(tmp)
        store.mkdir(parents=True, exist_ok=True)
        (store / "none.toml").write_text("")
        changes = {  # name: (rate scale, server flags, prediction settings), in CHANGES order
            "rate-0.5": (0.5, [], {"rate_scale": 0.5}),
            "rate-1.5": (1.5, [], {"rate_scale": 1.5}),
            "seqs": (1.0, ["--max-num-seqs", "4"], {"max_num_seqs": 4}),
            "budget": (1.0, ["--max-num-batched-tokens", "64"], {"max_num_batched_tokens": 64}),
        }
        configs = {
            "base-a": (1.0, [], {}),
            **changes,
            **{rate_run(s, 1): (s, [], {"rate_scale": s}) for s in scales if s not in (0.5, 1.0, 1.5)},
            **{name: (s, [], {"rate_scale": s}) for name, s in later_passes(scales, args.passes)},
            **{name: changes[name.removeprefix("p2-")] for name in later_changes(args.passes)},
            "base-b": (1.0, [], {}),
        }
        if args.paired:  # base-1 .. base-4 after the first four changes: base-a, rate-0.5, base-1, rate-1.5, ...
            order = list(configs)
            for k, after in enumerate(CHANGES, start=1):
                order.insert(order.index(after) + 1, f"base-{k}")
            configs = {name: configs.get(name, configs["base-a"]) for name in order}
        if args.reuse:
            absent = [name for name in configs if not (store / name).is_dir()]
            if absent:
                print(f"not in {store}, left out: {', '.join(absent)}")
            configs = {name: c for name, c in configs.items() if name not in absent}
        t0 = time.monotonic()
        if not args.reuse:
            for name, (scale, flags, _) in configs.items():
                load = os.getloadavg()[0]
                one_run(store, name, args, rate=args.rate * scale, extra=flags)
                print(f"ran {name} ({time.monotonic() - t0:.0f} s; load average {load:.1f} before it)", flush=True)
        targets = slo_targets(store, args.slo)
        t = targets["*"]
        print(f"SLO targets: TTFT {t.ttft_ms:.0f} ms, TPOT {t.tpot_ms:.0f} ms ({args.slo})")
        real = {name: measured(store, name, targets) for name in configs}
        src = Source.of_run(open_run(store, "base-a"))
        model = fit_whatif(src, targets=targets)
        noise = {m: spread(real["base-a"][m], real["base-b"][m]) for m in METRICS}
        print("fit on base-a (replay of base-a against base-a):")
        print("  " + "  ".join(f"{m} {100 * rel(model.fitted[m], model.measured[m]):.0f}%" for m in METRICS))
        print("run-to-run noise (base-a vs base-b):")
        print("  " + "  ".join(f"{m} {100 * noise[m]:.0f}%" for m in METRICS))
        m0 = model.models.all_steps
        print(f"step time fitted on base-a: {m0.describe()}; form {m0.form}; its steps carried "
              f"{m0.seqs_low:g}-{m0.seqs_high:g} sequences (5th-95th percentile)")
        steps = {name: run_steps(store, name) for name in configs}
        print("step-time forms' mean error on held-out steps (5 blocks of consecutive steps, each predicted by a fit "
              "on the others), per run, and the form chosen:")
        for name in configs:
            print(f"  {name}: {heldout_line(steps[name])}")
        like = {name: decode_steps(steps[name]) for name in configs}
        speed = {name: slowdown(like[name], like["base-a"]) for name in configs}
        print("machine slowdown per run (median over batch sizes of its decode steps' median time / base-a's; "
              f"1.00: as fast as base-a; not used on fewer than {MIN_LIKE_STEPS} like steps, in brackets): "
              + ", ".join(f"{n} {v:.2f} ({like_steps(like[n], like['base-a'])})" for n, v in speed.items()))
        print("step time of decode steps of at most 4 sequences, fitted on the same run's steps of more than 4 "
              "(median predicted / measured; relative fit per form, and a linear absolute least-squares fit):")
        for name in configs:
            r, k = small_batch_extrapolation(steps[name], 4)
            if r:
                print(f"  {name} ({k} steps): " + ", ".join(f"{f} {v:.2f}" for f, v in r.items()))
        tally = Tally()
        predicted = {}
        print("each change predicted from base-a; drift: the run's like steps against base-a's (the machine's "
              "change of speed); corrected: predicted with step_time_scale=drift; noise: base-a against base-b")
        print(HEADER)
        for name, (_, _, settings) in configs.items():
            if name == "base-a" or name[len("base-"):].isdigit():
                continue
            predicted[name] = compare(model, name, settings, real[name], speed[name], noise, tally,
                                      name in CHANGES, "base-a")
        reruns = RerunTally(METRICS, bar_of)
        for name in CHANGES:
            if second_run(name) in configs:
                reruns.add(name, predicted[name], real[name], real[second_run(name)], noise)
        for line in reruns.lines():
            print(line)
        runs_of = runs_by_scale(scales, list(configs))
        sweep_runs = MeasuredSweep.read(store, runs_of, targets)
        measured_sweep = sweep_runs.pooled()
        sweep = model.sweep("rate_scale", list(scales))
        predicted_sweep = {v: p.metrics["slo.all.attainment"] for v, p in zip(sweep.values, sweep.predictions)}
        run_speed = {n: speed[n] if math.isfinite(speed[n]) else model_slowdown(steps[n], steps["base-a"], m0)
                     for n in configs}
        sweep_speed = {s: median([run_speed[n] for n in runs]) for s, runs in runs_of.items()}
        print("sweep runs' slowdown against base-a (like steps; in brackets, where too few: decode steps against "
              "base-a's model), and its median per rate scale: " + "; ".join(
                  ", ".join(f"{n} {run_speed[n]:.2f}" if math.isfinite(speed[n]) else f"{n} ({run_speed[n]:.2f})"
                            for n in runs) + f" -> {s}x {sweep_speed[s]:.2f}" for s, runs in runs_of.items()))
        corrected_sweep = {s: model.predict({"rate_scale": s, "step_time_scale": sweep_speed[s]}, ranges=False)
                           .metrics["slo.all.attainment"] if math.isfinite(sweep_speed[s]) else math.nan
                           for s in runs_of}
        print(f"slo.all.attainment by rate scale, predicted / drift-corrected / measured (pooled over "
              f"{sweep_runs.passes()} passes; 1x: every base run): " + ", ".join(
                  f"{s}x {100 * predicted_sweep[s]:.0f}% / {100 * corrected_sweep[s]:.0f}% / {100 * measured_sweep[s]:.0f}%"
                  for s in scales))
        hm = crossing(list(scales), [measured_sweep[s] for s in scales], TARGET_SHARE)
        print(breaks_line(sweep_runs, TARGET_SHARE))
        break_noise(sweep_runs, model, targets, TARGET_SHARE)
        for what, curve in (("predicted", predicted_sweep), ("drift-corrected", corrected_sweep)):
            hp = crossing(list(scales), [curve[s] for s in scales], TARGET_SHARE)
            gap = rel(hp, hm) if hp is not None and hm is not None else math.nan
            print(f"rate scale at which the SLO breaks ({100 * TARGET_SHARE:.0f}% of requests within target): "
                  f"{what} {'none in range' if hp is None else f'{hp:.2f}'}, measured "
                  f"{'none in range' if hm is None else f'{hm:.2f}'}; error {100 * gap:.0f}% (bar 15%)")
        print(tally.summary("done-when bar (rate 0.5x/1.5x, max_num_seqs, max_num_batched_tokens)"))
        contention_check(store, configs, steps, m0, {n: speed[n] if math.isfinite(speed[n]) else
                                                      model_slowdown(steps[n], steps["base-a"], m0) for n in configs})
        src.close()
        if args.paired:
            paired(store, configs, real, targets, like)
    print(f"drift-corrected median error (every prediction from base-a): {median(tally.corrected):.3f}")
    print(f"whatif_median_error={median(tally.raw):.3f}")


if __name__ == "__main__":
    main()
