"""
Preparing a request, by the shape of its body
=============================================

``python benchmarks/prepare_shapes.py [--base DIR] [--policy round_robin] [--rounds 5]
[--loop-s 0.2]``

The proxy benchmark's chat body is one user message: three brackets in 1 KiB. What
clients send is often not that: conversations of tens of turns, content parts,
an agent's tool definitions and tool calls whose arguments are JSON inside JSON
strings (escaped quotes), one long prompt. This measures, per body shape, the CPU
of ``Mesh.prepare`` (parse, the depth bound, the routing text, placement's inputs:
what every mode runs before placing), of the ``bounds.max_json_depth`` check on
its own, and of ``msgspec.json.decode`` of the same body (the floor: decoding it
into Python objects, nothing else), as the best of ``--rounds`` timed loops
(``time.process_time``) in one process.

``--base DIR`` measures the same shapes with another checkout's build (its own
``.venv``, this script run under it), in the same run: a before/after ratio.
The shapes are deterministic (no randomness).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from _common import best_us

from meshkit import Mesh
from meshkit.core import requests as core_requests

WORKERS = [f"http://127.0.0.1:{port}" for port in (1, 2, 3, 4)]
CHAT = "/v1/chat/completions"


def _words(i: int, n: int) -> str:
    return " ".join(f"word{(i * 7 + k) % 97}" for k in range(n))


def _tool(k: int) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": f"tool_{k}",
            "description": _words(k, 12),
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": _words(k + 1, 6)},
                    "filters": {
                        "type": "object",
                        "properties": {"tags": {"type": "array", "items": {"type": "string"}}},
                    },
                },
                "required": ["query"],
            },
        },
    }


def _conversation(turns: int, *, parts: bool = False, tools: int = 0) -> bytes:
    messages: list[dict[str, Any]] = [{"role": "system", "content": _words(0, 60)}]
    for i in range(turns):
        text = _words(i, 40)
        content: Any = [{"type": "text", "text": text}] if parts else text
        messages.append({"role": "user", "content": content})
        if tools:
            args = json.dumps({"query": _words(i, 5), "filters": {"tags": ["a", "b"]}})
            function = {"name": f"tool_{i % tools}", "arguments": args}
            call = {"id": f"call_{i}", "type": "function", "function": function}
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            result = json.dumps({"rows": [{"id": i, "text": _words(i, 20)}]})
            messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": result})
        else:
            messages.append({"role": "assistant", "content": _words(i + 1, 60)})
    body: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": 64}
    if tools:
        body["tools"] = [_tool(k) for k in range(tools)]
    return json.dumps(body).encode()


def _one_message(size: int) -> bytes:
    head = json.dumps({"model": "m", "messages": [{"role": "user", "content": ""}]}).encode()
    text = _words(3, size // 6 + 1)[: size - len(head)]
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": text}]}).encode()


#: name -> body; from the proxy benchmark's shape to an agent's long session
SHAPES: dict[str, Callable[[], bytes]] = {
    "one message, 1 KiB": lambda: _one_message(1024),
    "10 turns": lambda: _conversation(10),
    "40 turns, content parts": lambda: _conversation(40, parts=True),
    "agent: 20 turns, 5 tools": lambda: _conversation(20, tools=5),
    "agent: 100 turns, 10 tools": lambda: _conversation(100, tools=10),
    "one message, 1 MiB": lambda: _one_message(1 << 20),
}


def _best(fn: Callable[[], object], rounds: int, budget_s: float = 0.2) -> float:
    """µs per call: the best of ``rounds`` loops sized to ~``budget_s`` each."""
    t0 = time.process_time()
    fn()
    once = max(time.process_time() - t0, 1e-6)
    return best_us(fn, rounds, max(3, int(budget_s / once)))


def measure(policy: str, rounds: int, loop_s: float = 0.2) -> dict[str, dict[str, float]]:
    too_deep: Callable[[bytes, int], bool] = core_requests._too_deep
    mesh = Mesh(workers=WORKERS, policy=policy, lifecycle={"probe": False})
    match = mesh.resolve("POST", CHAT)
    assert match is not None
    out: dict[str, dict[str, float]] = {}
    try:
        for name, make in SHAPES.items():
            body = make()
            headers = [(b"content-type", b"application/json")]
            view = mesh.prepare(match, body, headers, "")  # the body is valid: it parses
            assert view.model == "m"
            out[name] = {
                "bytes": float(len(body)),
                "brackets": float(body.count(b"{") + body.count(b"[")),
                "prepare_us": _best(
                    lambda: mesh.prepare(match, body, headers, ""),  # noqa: B023
                    rounds,
                    loop_s,
                ),
                "depth_us": _best(lambda: too_deep(body, 64), rounds, loop_s),  # noqa: B023
                "decode_us": _best(lambda: msgspec.json.decode(body), rounds, loop_s),  # noqa: B023
            }
    finally:
        mesh.close()
    return out


def _under(base: Path, policy: str, rounds: int, loop_s: float) -> dict[str, dict[str, float]]:
    python = base / ".venv" / "bin" / "python"
    cmd = [str(python), str(Path(__file__).resolve()), "--emit-json"]
    cmd += ["--policy", policy, "--rounds", str(rounds), "--loop-s", str(loop_s)]
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=base)
    result: dict[str, dict[str, float]] = json.loads(done.stdout)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/prepare_shapes.py")
    ap.add_argument("--base", help="another checkout (its own .venv), measured alike")
    ap.add_argument("--policy", default="round_robin")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--loop-s", type=float, default=0.2, help="seconds per timed loop")
    ap.add_argument("--emit-json", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.emit_json:
        print(json.dumps(measure(ns.policy, ns.rounds, ns.loop_s)))
        return 0
    from _common import require_current_install

    require_current_install()
    this = measure(ns.policy, ns.rounds, ns.loop_s)
    base = None
    if ns.base:
        base = _under(Path(ns.base).resolve(), ns.policy, ns.rounds, ns.loop_s)
    cols = "| shape | bytes | brackets | prepare µs | depth check µs | decode µs "
    cols += "| prepare / decode |"
    if base:
        cols += " prepare, base µs | this / base | depth check, base µs |"
    print(cols)
    print("|" + "---|" * (cols.count("|") - 1))
    for name, m in this.items():
        row = (
            f"| {name} | {m['bytes']:,.0f} | {m['brackets']:,.0f} | {m['prepare_us']:,.1f} "
            f"| {m['depth_us']:,.1f} | {m['decode_us']:,.1f} "
            f"| {m['prepare_us'] / m['decode_us']:.2f} |"
        )
        if base:
            b = base[name]
            row += f" {b['prepare_us']:,.1f} | {m['prepare_us'] / b['prepare_us']:.2f} "
            row += f"| {b['depth_us']:,.1f} |"
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
