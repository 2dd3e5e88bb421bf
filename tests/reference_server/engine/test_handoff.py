"""Handoff between two engines: export after prefill, admit with the KV, resume.

Two engines with the same seed hold the same weights, so a request prefilled on one and
continued on the other must produce the tokens of a plain run on one engine: greedy, and
seeded sampling too (each token's random draws depend on the request's seed and the
token's index only)."""

from __future__ import annotations

import pytest
import torch

from reference_server.engine import Engine, EngineConfig, RecordingObserver
from reference_server.engine.handoff import HANDOFF_FINISH_REASON, admit_prefilled, export_prefilled, resume
from reference_server.engine.hooks import RequestFinished
from reference_server.model import SamplingParams

torch.set_num_threads(1)
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=10, temperature=1.0, seed=1234, ignore_eos=True)
PROMPT = "Disaggregated serving moves the KV cache."  # 42 tokens with bos: 11 blocks of 4, the last partial


def make_engine(**kw) -> Engine:
    base = dict(model="tiny", block_size=4, num_device_blocks=32, device="cpu")
    base.update(kw)
    return Engine(EngineConfig(**base))


def run(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).append(out.token_id)
    return tokens


def reference(sampling: SamplingParams = GREEDY) -> list[int]:
    with make_engine() as e:
        tokens = list(e.generate([PROMPT], sampling)[0].token_ids)
    if sampling is SEEDED:
        assert tokens != reference(GREEDY)  # really sampled, not argmax
    return tokens


def prefill_and_export(engine: Engine, rid: str = "r", sampling: SamplingParams = GREEDY):
    engine.add_request(rid, PROMPT, sampling)
    outs = engine.step()  # the whole prompt fits one step: prefill + first token
    assert [o.token_index for o in outs] == [0]
    return outs[0], export_prefilled(engine, rid)


def test_export_frees_blocks_and_reports_transferred():
    with make_engine() as src:
        obs = RecordingObserver()
        src.add_observer(obs)
        first, state = prefill_and_export(src)
        assert state.num_computed_tokens == 42 and state.num_blocks == 11
        assert state.output_token_ids == (first.token_id,)
        assert len(state.data) == 11 * src.runner.bytes_per_block
        assert src.block_manager.usage().num_used == (0, 0, 0)
        assert not src.has_unfinished()
        finished = obs.of_type(RequestFinished)
        assert [f.reason for f in finished] == [HANDOFF_FINISH_REASON]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_admitted_request_continues_identically(sampling):
    expected = reference(sampling)
    with make_engine() as src, make_engine(num_device_blocks=40) as dst:
        first, state = prefill_and_export(src, sampling=sampling)
        seq = dst.prepare_request("r", PROMPT, sampling)
        assert admit_prefilled(dst, seq, state.output_token_ids, state.data)
        rest = run(dst)["r"]
        assert [first.token_id, *rest] == expected
        assert dst.block_manager.usage().num_used == (0, 0, 0)


def test_admit_refuses_without_room_and_changes_nothing():
    with make_engine() as src, make_engine(num_device_blocks=12) as dst:
        dst.add_request("hog", "x" * 30, SamplingParams(max_tokens=1))  # 31 tokens: 8 of the 12 blocks
        dst.step()
        dst.add_request("hog2", "y" * 14, SamplingParams(max_tokens=40, ignore_eos=True))
        dst.step()  # 4 more blocks: the device tier is full
        _, state = prefill_and_export(src)
        seq = dst.prepare_request("r", PROMPT, GREEDY)
        used = dst.block_manager.usage().num_used
        assert not admit_prefilled(dst, seq, state.output_token_ids, state.data)
        assert dst.block_manager.usage().num_used == used
        assert dst.scheduler.get("r") is None


def test_admit_rejects_a_wrong_byte_count():
    with make_engine() as dst:
        seq = dst.prepare_request("r", PROMPT, GREEDY)
        with pytest.raises(ValueError, match="bytes"):
            admit_prefilled(dst, seq, (5,), b"\0" * 10)
        assert dst.block_manager.usage().num_used == (0, 0, 0)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("num_delivered", [1, 4])
def test_resume_continues_after_delivered_tokens(num_delivered, sampling):
    expected = reference(sampling)
    with make_engine() as e:
        seq = e.prepare_request("r", PROMPT, sampling)
        resume(e, seq, expected[:num_delivered])
        outs = []
        while e.has_unfinished():
            outs.extend(e.step())
        assert [o.token_index for o in outs] == list(range(num_delivered, len(expected)))
        assert [o.token_id for o in outs] == expected[num_delivered:]


def test_resume_rejects_tokens_past_max_tokens():
    with make_engine() as e:
        seq = e.prepare_request("r", PROMPT, SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="no output tokens left"):
            resume(e, seq, [1, 2])
