"""The event loop keeps running while the pool tokenizes MiB prompts.

No wall-clock assertion: a ticker coroutine counts its own wake-ups, and the
count while the pool tokenizes is compared with the count while the same work
blocks the loop (the control: ``Tokenizer.encode`` called on the loop itself).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

from meshkit.prepare.pool import PoolConfig, PreparePool
from meshkit.prepare.tokenizers import TokenizerRegistry

MIB = 1024 * 1024


def _prompts() -> list[str]:
    words = "the quick brown fox jumps over the lazy dog 你好世界 def f(x): return x * 2\n"
    return [(words * (MIB // len(words) + 1))[:MIB] + str(i) for i in range(2)]


async def _ticks_during(work: Callable[[], Awaitable[None]]) -> int:
    ticks = 0
    stop = False

    async def ticker() -> None:
        nonlocal ticks
        while not stop:
            await asyncio.sleep(0.001)
            ticks += 1

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)  # the ticker is running
    before = ticks
    await work()
    during = ticks - before
    stop = True
    await task
    return during


def test_the_loop_keeps_ticking_while_the_pool_tokenizes(qwen_path: Path) -> None:
    registry = TokenizerRegistry()
    registry.register(None, qwen_path)
    pool = PreparePool(PoolConfig(workers=1, max_tokenize_bytes=8 * MIB))
    prompts = _prompts()
    lengths: list[int] = []

    async def in_pool() -> None:
        for prompt in prompts:
            tok = registry.get(None)
            assert tok is not None

            def job(p: str = prompt) -> int:
                loaded = registry.get(None)  # the worker's group copy
                assert loaded is not None
                return len(loaded.encode(p, add_special_tokens=False))  # encode_batch_fast

            lengths.append(await pool.run_async(job))

    async def on_the_loop() -> None:
        tok = registry.get(None)
        assert tok is not None
        for prompt in prompts:
            # Deliberately wrong: `encode` holds the GIL and runs on the loop.
            lengths.append(len(tok.tokenizer.encode(prompt, add_special_tokens=False).ids))

    async def main() -> tuple[int, int]:
        return await _ticks_during(in_pool), await _ticks_during(on_the_loop)

    try:
        ticks_pool, ticks_control = asyncio.run(main())
    finally:
        pool.shutdown()
    assert lengths[:2] == lengths[2:] and min(lengths) > 100_000
    assert ticks_pool > 5 * max(ticks_control, 1), (ticks_pool, ticks_control)
