"""
``python -m meshkit.mock``: run a mock worker from the command line
====================================================================

::

    python -m meshkit.mock --port 9001 --name w1 --apis chat,completions \
        --first-token-ms 20 --per-token-ms 5 --cache-tokens 4096

KV events as vLLM publishes them (needs ``--cache-tokens``)::

    python -m meshkit.mock --cache-tokens 65536 --kv-events tcp://127.0.0.1:5557 \
        --kv-replay tcp://127.0.0.1:5558 --tokenizer path/to/tokenizer.json

Prints ``meshkit mock worker <name> listening on <url>`` once bound (then, with
``--kv-events``, ``kv events on <endpoint>`` and ``kv replay on <endpoint>``), then
serves until SIGINT or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from meshkit.mock.config import API_NAMES, MockConfig
from meshkit.mock.loop import new_event_loop
from meshkit.mock.server import MockWorker

__all__ = ["build_parser", "run_mock_worker"]


def build_parser() -> argparse.ArgumentParser:
    d = MockConfig()
    p = argparse.ArgumentParser(
        prog="python -m meshkit.mock", description="meshkit mock inference worker"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = any free port")
    p.add_argument("--model", default=d.model)
    p.add_argument("--api-key", default=None)
    p.add_argument("--apis", default=None, help=f"comma list of {','.join(sorted(API_NAMES))}")
    p.add_argument("--first-token-ms", type=float, default=d.first_token_ms)
    p.add_argument("--per-token-ms", type=float, default=d.per_token_ms)
    p.add_argument("--output-tokens", type=int, default=d.output_tokens)
    p.add_argument("--dp-size", type=int, default=d.dp_size)
    p.add_argument("--error-rate", type=float, default=d.error_rate)
    p.add_argument("--fail-status", type=int, default=d.fail_status)
    p.add_argument("--crash-after-chunks", type=int, default=None)
    p.add_argument("--cache-tokens", type=int, default=d.cache_tokens)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument(
        "--cache-holds-running",
        action="store_true",
        help="running requests hold their KV blocks and others wait for room, as in vLLM "
        "(needs --cache-tokens)",
    )
    p.add_argument(
        "--cache-outputs",
        action="store_true",
        help="a request's output joins the prefix cache when it ends, as in vLLM",
    )
    p.add_argument("--prefill-ms-per-token", type=float, default=d.prefill_ms_per_token)
    p.add_argument("--sleep-mode", action="store_true")
    p.add_argument("--wake-ms", type=float, default=d.wake_ms)
    p.add_argument("--sleep-ms", type=float, default=d.sleep_ms)
    p.add_argument("--name", default=d.name)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--kv-events", default=None, help="ZeroMQ PUB endpoint for KV events (port 0 = any)"
    )
    p.add_argument("--kv-replay", default=None, help="ZeroMQ ROUTER endpoint for replays")
    p.add_argument("--kv-topic", default=d.kv_topic)
    p.add_argument("--kv-events-format", choices=("map", "array"), default=d.kv_events_format)
    p.add_argument("--kv-replay-buffer", type=int, default=d.kv_replay_buffer)
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer.json (or its directory) for chat/completions"
    )
    p.add_argument("--max-responses", type=int, default=d.max_responses)
    p.add_argument("--max-conversations", type=int, default=d.max_conversations)
    p.add_argument("--max-conversation-items", type=int, default=d.max_conversation_items)
    return p


def config_from_args(ns: argparse.Namespace) -> MockConfig:
    apis = None
    if ns.apis:
        apis = frozenset(a.strip() for a in ns.apis.split(",") if a.strip())
    return MockConfig(
        model=ns.model,
        api_key=ns.api_key,
        apis=apis,
        first_token_ms=ns.first_token_ms,
        per_token_ms=ns.per_token_ms,
        output_tokens=ns.output_tokens,
        dp_size=ns.dp_size,
        error_rate=ns.error_rate,
        fail_status=ns.fail_status,
        crash_after_chunks=ns.crash_after_chunks,
        cache_tokens=ns.cache_tokens,
        prefill_ms_per_token=ns.prefill_ms_per_token,
        sleep_mode=ns.sleep_mode,
        wake_ms=ns.wake_ms,
        sleep_ms=ns.sleep_ms,
        name=ns.name,
        seed=ns.seed,
        block_size=ns.block_size,
        cache_holds_running=ns.cache_holds_running,
        cache_outputs=ns.cache_outputs,
        kv_events=ns.kv_events,
        kv_replay=ns.kv_replay,
        kv_topic=ns.kv_topic,
        kv_events_format=ns.kv_events_format,
        kv_replay_buffer=ns.kv_replay_buffer,
        tokenizer=ns.tokenizer,
        max_responses=ns.max_responses,
        max_conversations=ns.max_conversations,
        max_conversation_items=ns.max_conversation_items,
    )


async def _serve(worker: MockWorker) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await worker.start()
    print(f"meshkit mock worker {worker.config.name} listening on {worker.url}", flush=True)
    if worker.kv_events_endpoint is not None:
        print(f"kv events on {worker.kv_events_endpoint}", flush=True)
    if worker.kv_replay_endpoint is not None:
        print(f"kv replay on {worker.kv_replay_endpoint}", flush=True)
    try:
        await stop.wait()
    finally:
        await worker.stop()


def run_mock_worker(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), serve until SIGINT/SIGTERM; exit code."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        config = config_from_args(ns)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        worker = MockWorker(config, host=ns.host, port=ns.port)
    except Exception as exc:  # a tokenizer that does not load (ConfigError), no pyzmq
        print(f"meshkit mock worker: {exc}", file=sys.stderr)
        return 1
    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            runner.run(_serve(worker))
    except OSError as exc:
        print(f"meshkit mock worker: {exc}", file=sys.stderr)
        return 1
    return 0
