"""A session workload with planted truth, run on the reference engine and traced by the real engine tracer
(shared by the analyzer and report tests of sessions).

Block size 4; two sessions, A and B. Turn 0's prompt is 22 distinct tokens; each later turn's
prompt is the previous prompt, the previous answer's 5 tokens and 6 new tokens. A turn that ends
computed prompt + 5 - 1 tokens (the last sampled token is never fed back), so the next turn
carries floor((P + 4) / 4) full blocks: 6 blocks (24 tokens) after turn 0 (P = 22), 9 blocks
(36 tokens) after turn 1 (P = 33). Between turns a filler request (no session) may run.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from analyzers.source import Source
from instrument.reference_engine import EngineTracer
from reference_server.engine.config import EngineConfig
from reference_server.engine.engine import Engine
from reference_server.model import SamplingParams
from tokentrace.recorder import BufferedRecorder
from tokentrace.recorder.sink import InMemorySink
from tokentrace.schema import Role
from tokentrace.store.writer import StoreWriter

torch.set_num_threads(1)

BS, P0, M, N = 4, 22, 5, 6
CARRIED = {1: 24, 2: 36}  # tokens carried into turn k (see the module doc)
TABLE_NAMES = ("requests", "spans", "tokens", "cache_events", "instances")


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 256) for _ in range(n)]


def run_sessions(*, policy: str, num_turns: int, num_device_blocks: int, filler: int, num_host_blocks: int = 0,
                 store: Path | None = None, run_id: str | None = None):
    """Run the workload; (Source over the recorded tables, the tables), or into ``store`` as ``run_id``
    (then the Source is None). ``filler``: device blocks the filler request between turns needs (0: none)."""
    sink = StoreWriter(store, run_id=run_id) if store is not None else InMemorySink()
    rec = BufferedRecorder(sink, instance_id=sink.instance_id if isinstance(sink, StoreWriter) else 11,
                           flush_interval_s=0.05)
    rec.instance(role=Role.COLOCATED, name="engine")
    engine = Engine(EngineConfig(model="tiny", block_size=BS, num_device_blocks=num_device_blocks,
                                 num_host_blocks=num_host_blocks, max_num_batched_tokens=64, device="cpu",
                                 kv_retention=policy, prefetch_waiting=False))
    engine.add_observer(EngineTracer(rec))
    rng = random.Random(7)
    sp = SamplingParams(max_tokens=M, ignore_eos=True)
    prompts = {s: _tokens(rng, P0) for s in "AB"}
    for turn in range(num_turns):
        outputs: dict[str, list[int]] = {}
        for s in "AB":
            engine.add_request(f"{s}-{turn}", prompts[s], sp, session=f"sess-{s}")
            outputs[s] = _drain(engine)
        if filler and turn + 1 < num_turns:  # with filler = every device block: evicts whatever is cached and free
            engine.add_request(f"filler-{turn}", _tokens(rng, filler * BS - 1), SamplingParams(max_tokens=1))
            _drain(engine)
        for s in "AB":
            prompts[s] = prompts[s] + outputs[s] + _tokens(rng, N)
    rec.close()
    if store is not None:
        return None, {}
    tables = {name: sink.table(name) for name in TABLE_NAMES}
    return Source.of_tables(**tables), tables


def _drain(engine: Engine) -> list[int]:
    """Step until idle; the output token ids, in order."""
    out = []
    while engine.has_unfinished():
        out.extend(o.token_id for o in engine.step())
    return out
