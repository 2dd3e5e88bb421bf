from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from reference_server.model.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    apply_chat_template,
    load_tokenizer,
)

TEXTS = ["hello world", "naïve café — ünïcödé", "emoji 🙂🚀 and 中文字符", "", "a\nb\tc"]


def _write_hf_tokenizer(folder, *, with_config: bool = False) -> None:
    tok = RustTokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, hello there", "the world is wide"] * 20, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(folder / "tokenizer.json"))
    if with_config:
        (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<s>"}))


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id == 256
        assert tok.decode(ids) == text
    assert ByteTokenizer(add_bos=False).encode("hi") == [104, 105]
    assert tok.eos_token_id == 257 and tok.vocab_size == 259
    assert tok.decode([104, 257, 258, 105]) == "hi"  # specials are skipped
    with pytest.raises(ValueError, match="259"):
        tok.decode([259])


def _stream(tokenizer, ids, prompt_ids=()) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids)
    deltas = [detok.push(i) for i in ids]
    deltas.append(detok.flush())
    return deltas, detok.text


def test_incremental_detokenizer_emits_only_complete_characters() -> None:
    tok = ByteTokenizer(add_bos=False)
    text = "aé🙂b"
    deltas, full = _stream(tok, tok.encode(text))
    # bytes: a | c3 a9 | f0 9f 99 82 | b
    assert deltas == ["a", "", "é", "", "", "", "🙂", "b", ""]
    assert full == text
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(text: str) -> None:
    tok = ByteTokenizer()
    prompt = tok.encode("prompt ü")
    deltas, full = _stream(tok, ByteTokenizer(add_bos=False).encode(text), prompt)
    assert "".join(deltas) == full == text


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=40))
def test_incremental_bytes_property(text: str) -> None:
    tok = ByteTokenizer(add_bos=False)
    deltas, full = _stream(tok, tok.encode(text))
    assert "".join(deltas) == full == text
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in text


def test_flush_emits_incomplete_tail_as_replacement() -> None:
    tok = ByteTokenizer(add_bos=False)
    detok = IncrementalDetokenizer(tok)
    assert detok.push(ord("x")) == "x"
    assert detok.push(0xE4) == ""  # first byte of a 3-byte character
    assert detok.flush() == "\ufffd"


def test_hf_tokenizer(tmp_path) -> None:
    _write_hf_tokenizer(tmp_path)
    tok = HFTokenizer(tmp_path)
    assert tok.eos_token_id == tok._tok.token_to_id("</s>")
    assert tok.bos_token_id == tok._tok.token_to_id("<s>")
    assert tok.vocab_size <= 300
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids) == text
        deltas, full = _stream(tok, ids[1:], ids[:1])
        assert "".join(deltas) == full == text
    # multi-byte characters the BPE never merged arrive as several byte tokens
    assert len(tok.encode("🙂")) > 2


def test_incremental_keeps_sentencepiece_leading_spaces(tmp_path) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\u2581hello": 3, "\u2581world": 4, "!": 5}
    rust = RustTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    rust.pre_tokenizer = pre_tokenizers.Metaspace()
    rust.decoder = decoders.Metaspace()  # decode(["\u2581world"]) alone drops the space
    rust.add_special_tokens(["<unk>", "<s>", "</s>"])
    rust.save(str(tmp_path / "tokenizer.json"))
    tok = HFTokenizer(tmp_path)
    assert tok.decode([4]) == "world"
    deltas, full = _stream(tok, [4, 5, 3, 2], prompt_ids=[3])
    assert deltas == [" world", "!", " hello", "", ""]
    assert full == " world! hello"


def test_hf_tokenizer_special_token_hints(tmp_path) -> None:
    _write_hf_tokenizer(tmp_path, with_config=True)
    assert HFTokenizer(tmp_path).eos_token_id == HFTokenizer(tmp_path).bos_token_id
    assert HFTokenizer(tmp_path / "tokenizer.json", eos_token_id=5).eos_token_id == 5


def test_hf_tokenizer_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="no tokenizer.json"):
        HFTokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ValueError, match="cannot load tokenizer"):
        HFTokenizer(tmp_path)


def test_load_tokenizer(tmp_path) -> None:
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)  # no tokenizer.json
    _write_hf_tokenizer(tmp_path)
    assert isinstance(load_tokenizer(tmp_path), HFTokenizer)
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")


def test_chat_template() -> None:
    text = apply_chat_template([{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hi"}])
    assert text == "<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\n"
    for bad, message in [([], "non-empty"), ([{"role": "bot", "content": "x"}], "role"),
                         ([{"role": "user", "content": 3}], "content"), (["x"], "object")]:
        with pytest.raises(ValueError, match=message):
            apply_chat_template(bad)
