"""
meshkit standalone on its built-in server (what ``meshkit serve`` runs): the
gateway (``MeshMiddleware`` around ``ServeApp``) on ``meshkit.server.h1.conn``.

``MESHBENCH_WORKERS=... python benchmarks/frontends/meshkit_builtin.py --port 8000``

``--processes N`` (N > 1) runs ``meshkit serve --processes N`` itself, the
supervisor and its children, on a TOML file written from the same settings.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _env import mesh_kwargs

from meshkit import Mesh
from meshkit.server.runner import serve
from meshkit.server.settings import ServeSettings


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--processes", type=int, default=1)
    ns = ap.parse_args()
    if ns.processes > 1:
        raise SystemExit(_supervised(ns.host, ns.port, ns.processes))
    settings = ServeSettings(
        host=ns.host, port=ns.port, grace_s=1.0, log_level="warning", access_log=False
    )
    serve(Mesh(**mesh_kwargs()), settings)


def config_toml(kw: dict[str, Any]) -> str:
    """``mesh_kwargs()`` as the TOML file ``meshkit serve --config`` reads."""
    lines = [f"policy = {json.dumps(kw['policy'])}"]
    if kw.get("tokenizer"):
        lines.append(f"tokenizer = {json.dumps(kw['tokenizer'])}")
    for name, opts in kw.get("policies", {}).items():
        lines.append(f"[policies.{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in opts.items()]
    if kw.get("lifecycle"):
        lines.append("[lifecycle]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in kw["lifecycle"].items()]
    lines += [f"[[workers]]\nurl = {json.dumps(u)}" for u in kw["workers"]]
    return "\n".join(lines) + "\n"


def _supervised(host: str, port: int, processes: int) -> int:
    from meshkit.server.cli import main as meshkit

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(config_toml(mesh_kwargs()))
    args = ["serve", "--config", f.name, "--host", host, "--port", str(port)]
    return meshkit([*args, "--grace", "1", "--log-level", "warning", "--processes", str(processes)])


if __name__ == "__main__":
    main()
