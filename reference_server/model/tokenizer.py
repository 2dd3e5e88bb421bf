"""Tokenizers (byte-level and Hugging Face ``tokenizer.json``), incremental detokenization,
and the chat template.

All methods are pure and may be called from any thread; an
:class:`IncrementalDetokenizer` holds per-request state and belongs to one request.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, Sequence

_REPLACEMENT = "\ufffd"  # what a decoder emits for an incomplete UTF-8 sequence
# Special tokens HF tokenizers use for end of sequence, in order of preference.
_EOS_CANDIDATES = ("</s>", "<|end_of_text|>", "<|endoftext|>", "<|eot_id|>", "<eos>", "<|im_end|>")
_BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<bos>")
_CHAT_ROLES = ("system", "user", "assistant")


class Tokenizer(Protocol):
    """Text <-> token ids. Implementations are immutable and thread-safe."""

    eos_token_id: int
    bos_token_id: int | None
    vocab_size: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with the bos token first when the tokenizer adds one.
        ``ValueError`` for text that is not valid Unicode (a lone surrogate)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``; special tokens are skipped."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then bos (256), eos (257), pad (258).

    ``encode`` prepends bos (as HF Llama tokenizers do) unless ``add_bos=False``.
    ``decode`` skips special ids and replaces invalid UTF-8 with U+FFFD; it
    raises ValueError for ids outside the vocabulary.
    """

    BOS = 256
    EOS = 257
    PAD = 258

    def __init__(self, *, add_bos: bool = True) -> None:
        self.add_bos = add_bos
        self.bos_token_id: int | None = self.BOS
        self.eos_token_id = self.EOS
        self.pad_token_id = self.PAD
        self.vocab_size = 259

    def encode(self, text: str) -> list[int]:
        ids = list(_utf8(text))
        return [self.BOS, *ids] if self.add_bos else ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """The raw bytes of ``ids`` (specials skipped)."""
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} outside the byte vocabulary (0..258)")
        return bytes(i for i in ids if i < 256)


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (via the ``tokenizers`` package).

    ``path`` is the file or a folder holding it. eos/bos ids come from the
    arguments, else ``tokenizer_config.json`` / ``config.json`` beside it, else
    well-known special token names. Raises ValueError when the file is missing
    or malformed, or no eos token can be found.
    """

    def __init__(self, path: str | Path, *, eos_token_id: int | None = None,
                 bos_token_id: int | None = None) -> None:
        from tokenizers import Tokenizer as _RustTokenizer

        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise ValueError(f"no tokenizer.json at {file}")
        try:
            self._tok = _RustTokenizer.from_file(str(file))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise ValueError(f"{file}: cannot load tokenizer ({exc})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        hints = _special_token_hints(file.parent)
        self.eos_token_id = self._resolve(eos_token_id, hints.get("eos"), _EOS_CANDIDATES)
        self.bos_token_id = self._resolve(bos_token_id, hints.get("bos"), _BOS_CANDIDATES)
        if self.eos_token_id is None:
            raise ValueError(f"{file}: cannot determine the eos token; pass eos_token_id")

    def _resolve(self, explicit: int | None, hint: int | str | None,
                 candidates: Sequence[str]) -> int | None:
        if explicit is not None:
            return explicit
        if isinstance(hint, int):
            return hint
        for name in ([hint] if isinstance(hint, str) else []) + list(candidates):
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str) -> list[int]:
        _utf8(text)  # the Rust side would raise its own error for a lone surrogate
        return list(self._tok.encode(text).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def _utf8(text: str) -> bytes:
    """``text`` as UTF-8; ``ValueError`` naming the first lone surrogate (it has no UTF-8 form)."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text is not valid Unicode: it holds a lone surrogate {text[exc.start]!r} at character "
                         f"{exc.start}") from None


def _special_token_hints(folder: Path) -> dict[str, int | str]:
    """eos/bos from ``tokenizer_config.json`` (token strings) or ``config.json`` (ids)."""
    hints: dict[str, int | str] = {}
    for name, key_suffix in (("config.json", "_token_id"), ("tokenizer_config.json", "_token")):
        file = folder / name
        if not file.is_file():
            continue
        try:
            raw = json.loads(file.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        for kind in ("eos", "bos"):
            value = raw.get(kind + key_suffix) if isinstance(raw, dict) else None
            if isinstance(value, dict):
                value = value.get("content")
            if isinstance(value, list):
                value = value[0] if value else None
            if isinstance(value, (int, str)) and not isinstance(value, bool):
                hints[kind] = value
    return hints


def load_tokenizer(checkpoint_dir: str | Path | None) -> Tokenizer:
    """The tokenizer for a checkpoint folder: its ``tokenizer.json`` when present,
    else the byte tokenizer (also for ``None``). Raises ValueError for a missing folder."""
    if checkpoint_dir is None:
        return ByteTokenizer()
    folder = Path(checkpoint_dir)
    if not folder.is_dir():
        raise ValueError(f"checkpoint folder {folder} does not exist")
    if (folder / "tokenizer.json").is_file():
        return HFTokenizer(folder)
    return ByteTokenizer()


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, one request at a time.

    ``push`` returns only complete characters: a UTF-8 character split over
    several tokens (bytes) is emitted once its last byte arrives. Deltas are
    computed from a sliding window (``decode(window) - decode(prefix)``) so
    tokenizers whose pieces depend on their neighbours (SentencePiece's leading
    spaces) also come out right; ``prompt_ids`` seeds that window.
    """

    def __init__(self, tokenizer: Tokenizer, *, prompt_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = list(prompt_ids[-6:])  # a few prompt tokens for context
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # all text emitted so far

    def push(self, token_id: int) -> str:
        """Add one token; return the new text it completes (maybe "")."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""  # an incomplete character (or nothing visible) so far
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the stream, return held-back text (incomplete bytes become U+FFFD)."""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = decode(self._ids[self._prefix_offset:])
        delta = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta


def apply_chat_template(messages: list[dict]) -> str:
    """Render chat messages as role-tagged lines, ending with the assistant's tag.

    Each message ``{"role": r, "content": c}`` (r in system/user/assistant,
    c a string) becomes ``"<|r|>\\n" + c + "\\n"``; the result ends with
    ``"<|assistant|>\\n"`` so the model continues as the assistant. Raises
    ValueError on an empty list, an unknown role or non-string content.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list")
    parts = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be an object")
        role, content = message.get("role"), message.get("content")
        if role not in _CHAT_ROLES:
            raise ValueError(f"messages[{i}].role must be one of {_CHAT_ROLES}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string")
        parts.append(f"<|{role}|>\n{content}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)
