"""A FastAPI app around a real transformers model, traced by the middleware and the model adapter.

The app is docs/instrumenting.md's own example (a 2-layer Llama with random weights built from a
transformers config, a byte-level tokenizer; no network), served by uvicorn on 127.0.0.1 and
driven by concurrent streaming requests; the run must hold every stage of every token, joined to
the middleware's request rows, and pass the attribution check.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the deployments helpers
from deployments import serve_app  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("fastapi")

import tokentrace  # noqa: E402
from instrument.hf_transformers import TokenStreamer, TransformersAdapter  # noqa: E402
from tokentrace.adapters import adapter_for  # noqa: E402
from tokentrace.schema import REQUESTS, SPANS, TOKENS, Stage, col  # noqa: E402

pytestmark = pytest.mark.timeout(300)

DOC = Path(__file__).resolve().parents[2] / "docs" / "instrumenting.md"
NUM_REQUESTS = 6
MAX_TOKENS = 12


def _doc_app(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Import the doc's hf_server.py (as its reader would save it) without running its __main__."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (source,) = re.findall(r"save as\s*`hf_server\.py`.*?```python\n(.*?)```", DOC.read_text(), re.S)
    path = tmp_path / "hf_server.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("hf_server_doc_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _serve(app: Any) -> contextlib.AbstractContextManager[str]:
    return serve_app(app, lifespan="off", timeout_s=30)


async def _stream_all(url: str) -> list[list[str]]:
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(n: int) -> list[str]:
            texts = []
            headers = {"X-Request-Id": f"req-{n}", "X-Tenant": "acme" if n % 2 else "globex"}
            body = {"prompt": f"Request {n}: tell me where the time goes.", "max_tokens": MAX_TOKENS}
            async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as response:
                assert response.status_code == 200
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        texts.append(line)
            return texts

        return list(await asyncio.gather(*(one(n) for n in range(NUM_REQUESTS))))


def test_the_documented_fastapi_transformers_server_traces_every_stage_of_every_token(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    server = _doc_app(tmp_path, monkeypatch)
    assert isinstance(adapter_for(server.model), TransformersAdapter)
    with tokentrace.instrument(server.model, store=tmp_path / "traces", run="hf", role="gateway"):
        with _serve(server.app) as url:
            streams = asyncio.run(_stream_all(url))
    assert [len(s) for s in streams] == [MAX_TOKENS] * NUM_REQUESTS  # printable bytes: one delta per token

    run = tokentrace.open(tmp_path / "traces", run="hf")
    requests = run.table(REQUESTS.name).to_pandas()
    assert sorted(requests[col.TENANT]) == ["acme"] * 3 + ["globex"] * 3
    assert (requests[col.NUM_OUTPUT_TOKENS] == MAX_TOKENS).all()
    spans = run.table(SPANS.name).to_pandas()
    assert set(spans[col.REQUEST_ID]) == set(requests[col.REQUEST_ID])  # joined to the middleware's rows
    first = spans[spans[col.TOKEN_INDEX] == 0]
    later = spans[spans[col.TOKEN_INDEX] > 0]
    for stage in (Stage.GATEWAY_TOKENIZE, Stage.SCHEDULE_QUEUE, Stage.PREFILL_COMPUTE):
        assert (first[col.STAGE] == stage).sum() == NUM_REQUESTS, stage.name
    for stage in (Stage.DECODE_COMPUTE, Stage.DETOKENIZE, Stage.STREAM_RELAY, Stage.STREAM_SEND):
        assert (later[col.STAGE] == stage).sum() == NUM_REQUESTS * (MAX_TOKENS - 1), stage.name
    assert not (later[col.STAGE] == Stage.PREFILL_COMPUTE).any()
    tokens = run.table(TOKENS.name).to_pandas()
    assert len(tokens) == NUM_REQUESTS * MAX_TOKENS

    analysis = run.analyze()
    assert abs(analysis.unattributed_share()) < 0.01, analysis.attribution()
    assert analysis.overlap_share() < 0.01, analysis.attribution()


def test_outside_a_traced_request_the_streamer_only_streams() -> None:
    class Tokenizer:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(chr(i) for i in ids)

    class Ids(list):  # what generate hands a streamer: a tensor with shape, reshape() and tolist()
        @property
        def shape(self) -> tuple[int, ...]:
            return (len(self),)

        def reshape(self, *shape: int) -> Ids:
            return self

        def tolist(self) -> list[int]:
            return list(self)

    def generate(*, streamer: TokenStreamer, prompt: str) -> None:
        streamer.put(Ids([1, 2]))  # the prompt
        for ch in prompt:
            streamer.put(Ids([ord(ch)]))
        streamer.end()

    assert tokentrace.current_request() is None
    streamer = TokenStreamer(Tokenizer(), timeout_s=30)
    streamer.start(generate, prompt="hi!")
    assert list(streamer) == ["h", "i", "!"]


def test_a_failed_generation_ends_the_stream_with_its_error() -> None:
    def generate(*, streamer: TokenStreamer) -> None:
        raise ValueError("bad generate argument")

    streamer = TokenStreamer(object(), timeout_s=30)
    streamer.start(generate)
    with pytest.raises(RuntimeError, match="bad generate argument"):
        next(iter(streamer))


def test_a_batch_of_several_sequences_is_refused() -> None:
    import torch

    streamer = TokenStreamer(object(), timeout_s=30)
    with pytest.raises(ValueError, match="one sequence"):
        streamer.put(torch.zeros((2, 3), dtype=torch.long))
