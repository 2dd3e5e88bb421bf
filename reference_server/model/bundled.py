"""Models that ship with the package, loadable by name (``EngineConfig(model="trained")``).

``trained`` (about 1.1 M parameters) and ``trained-draft`` (about 0.13 M) are byte-level
Llama-style models trained on Python's documentation topics by
:mod:`reference_server.model.train` (the command, corpus, seed, steps, losses and held-out
perplexity are in ``docs/reference-server.md`` and each folder's ``training.json``). They
are HF-format folders under ``reference_server/weights/``: float16 tensors, run in float32.
``trained-draft`` is the draft model of speculative decoding for ``trained``; the target's
first layers also serve as an early-exit draft (it was trained for that).
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["BUNDLED_MODELS", "WEIGHTS_DIR", "bundled_checkpoint", "resolve_checkpoint"]

WEIGHTS_DIR = Path(__file__).resolve().parents[1] / "weights"
"""Where the bundled checkpoint folders live (package data)."""

BUNDLED_MODELS = ("trained", "trained-draft")
"""Names of the bundled models."""


def bundled_checkpoint(name: str) -> Path | None:
    """The checkpoint folder of bundled model ``name``; None when ``name`` is no bundled model.
    ``ValueError`` when it is one but its files are missing (a broken install)."""
    if name not in BUNDLED_MODELS:
        return None
    folder = WEIGHTS_DIR / name
    if not (folder / "config.json").is_file():
        raise ValueError(f"bundled model {name!r} is missing its files at {folder} (a broken install?)")
    return folder


def resolve_checkpoint(model: str, checkpoint: str | None) -> str | None:
    """The checkpoint folder an engine loads: ``checkpoint`` if given, else the bundled model
    ``model``'s folder, else None (``model`` is a preset with seeded random weights)."""
    if checkpoint:
        return checkpoint
    folder = bundled_checkpoint(model)
    return None if folder is None else str(folder)
