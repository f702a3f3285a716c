"""
The FastAPI baseline, written the way seed 000's benchmark describes the typical
Python frontend:

* FastAPI + uvicorn (uvloop, httptools), ``uvicorn --workers N``: one process per
  core of the frontend's allotment;
* a pydantic request model validates the body (FastAPI parses it as the handler's
  body parameter);
* tokenize workload: the *full* prompt is tokenized with
  ``run_in_executor(None, tokenizer.encode, prompt)`` and the first 256 token ids
  are hashed to pick the worker (prefix hash); proxy workload: round robin;
* aiohttp (one pooled session per process) forwards the client's original bytes,
  and the worker's body is returned as a ``Response``.

``MESHBENCH_WORKERS=... uvicorn --app-dir benchmarks/frontends fastapi_baseline:app``
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from _env import PREFIX_TOKENS, tokenizer_path, worker_urls
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict

URLS = [u + "/v1/completions" for u in worker_urls()]
_rr = itertools.cycle(URLS)

_tok_path = tokenizer_path()
if _tok_path is not None:
    from tokenizers import Tokenizer

    TOKENIZER: Any = Tokenizer.from_file(_tok_path)
else:
    TOKENIZER = None


class CompletionRequest(BaseModel):
    """The fields of an OpenAI ``/v1/completions`` request a frontend validates."""

    model_config = ConfigDict(extra="allow")

    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    user: str | None = None


_session: aiohttp.ClientSession | None = None


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    global _session
    _session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1000))
    yield
    await _session.close()


app = FastAPI(lifespan=lifespan)


def _text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if prompt and isinstance(prompt[0], str):
        return "".join(prompt)
    return ""


@app.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    raw = await request.body()  # the original bytes (cached by FastAPI's body parsing)
    if TOKENIZER is not None:
        loop = asyncio.get_running_loop()
        enc = await loop.run_in_executor(None, TOKENIZER.encode, _text(body.prompt))
        url = URLS[hash(tuple(enc.ids[:PREFIX_TOKENS])) % len(URLS)]
    else:
        url = next(_rr)
    assert _session is not None
    async with _session.post(url, data=raw, headers={"Content-Type": "application/json"}) as resp:
        content = await resp.read()
        return Response(
            content=content,
            status_code=resp.status,
            media_type=resp.headers.get("Content-Type"),
        )
