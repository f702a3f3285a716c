"""
meshkit standalone on its built-in server (what ``meshkit serve`` runs): the
gateway (``MeshMiddleware`` around ``ServeApp``) on ``meshkit.server.h1.conn``.

``MESHBENCH_WORKERS=... python benchmarks/frontends/meshkit_builtin.py --port 8000``
"""

from __future__ import annotations

import argparse
import sys
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
    ns = ap.parse_args()
    settings = ServeSettings(
        host=ns.host, port=ns.port, grace_s=1.0, log_level="warning", access_log=False
    )
    serve(Mesh(**mesh_kwargs()), settings)


if __name__ == "__main__":
    main()
