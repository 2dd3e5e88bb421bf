"""The training script of the bundled models: its forward is the model's, its command writes
checkpoints the engine loads, and it is seeded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from reference_server.engine import Engine, EngineConfig
from reference_server.model import LlamaModel, SamplingParams
from reference_server.model.train import DRAFT, EARLY_EXIT_LAYER, TARGET, corpus, forward_train, main

torch.set_num_threads(1)


@pytest.mark.parametrize("config", [TARGET, DRAFT], ids=["target", "draft"])
def test_training_forward_is_the_serving_models_forward(config) -> None:
    model = LlamaModel(config, seed=3).eval()
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        batched = forward_train(model, ids)[0]
        for row in range(2):
            torch.testing.assert_close(batched[row], model.forward_dense(ids[row]), atol=1e-4, rtol=1e-4)


def test_early_exit_logits_are_the_first_layers_through_the_final_norm() -> None:
    model = LlamaModel(TARGET, seed=3).eval()
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, early = forward_train(model, ids, exit_layer=EARLY_EXIT_LAYER)
        cut = LlamaModel(TARGET, seed=None)
        cut.load_state_dict(model.state_dict())
        del cut.model.layers[EARLY_EXIT_LAYER:]
        torch.testing.assert_close(early[0], cut.forward_dense(ids[0]), atol=1e-4, rtol=1e-4)


def test_corpus_is_pythons_documentation_with_every_20th_topic_held_out() -> None:
    train, held = corpus()
    assert b" the " in train and b" the " in held  # English prose
    assert len(train) > 20 * len(held) > 0
    assert corpus() == (train, held)  # deterministic


def test_the_training_command_writes_checkpoints_the_engine_loads(tmp_path: Path, capsys) -> None:
    main(["--out", str(tmp_path), "--steps", "2", "--threads", "1"])
    for name in ("trained", "trained-draft"):
        stats = json.loads((tmp_path / name / "training.json").read_text())
        assert stats["steps"] == 2 and stats["seed"] == 0 and stats["held_out_perplexity"] > 1
        assert ("early_exit_held_out_perplexity" in stats) == (name == "trained")
        engine = Engine(EngineConfig(checkpoint=str(tmp_path / name), device="cpu", block_size=4,
                                     num_device_blocks=64))
        out = engine.generate(["def "], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        assert len(out.token_ids) == 4
    assert '"trained"' in capsys.readouterr().out
    # seeded: the same command again writes the very same weights
    main(["--out", str(tmp_path / "again"), "--steps", "2", "--threads", "1"])
    for name in ("trained", "trained-draft"):
        assert (tmp_path / "again" / name / "model.safetensors").read_bytes() == \
            (tmp_path / name / "model.safetensors").read_bytes()
