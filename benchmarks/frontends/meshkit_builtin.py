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


def _supervised(host: str, port: int, processes: int) -> int:
    from meshkit.server.cli import main as meshkit

    kw = mesh_kwargs()
    lines = [f"policy = {json.dumps(kw['policy'])}"]
    if kw.get("tokenizer"):
        lines.append(f"tokenizer = {json.dumps(kw['tokenizer'])}")
    for name, opts in kw.get("policies", {}).items():
        lines.append(f"[policies.{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in opts.items()]
    lines += [f"[[workers]]\nurl = {json.dumps(u)}" for u in kw["workers"]]
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write("\n".join(lines) + "\n")
    args = ["serve", "--config", f.name, "--host", host, "--port", str(port)]
    return meshkit([*args, "--grace", "1", "--log-level", "warning", "--processes", str(processes)])


if __name__ == "__main__":
    main()
