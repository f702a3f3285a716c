"""A FastAPI app with its own routes, and meshkit routing its inference paths.

Run it (starts two local mock workers unless MESHKIT_WORKERS or MESHKIT_CONFIG is
set, then serves on 127.0.0.1:8000)::

    python examples/fastapi_app/app.py [--port 8000]

Your routes (``/hello``) are served by FastAPI; OpenAI/Anthropic paths
(``/v1/chat/completions``, ``/v1/messages``, ...) are placed on a worker by
:class:`meshkit.MeshMiddleware` before FastAPI sees them.

With your own workers and your own server::

    MESHKIT_WORKERS=http://10.0.0.5:8000 uvicorn --factory app:create_app
"""

from __future__ import annotations

import argparse
import contextlib
import os

import uvicorn
from fastapi import FastAPI

from meshkit import Mesh, MeshMiddleware
from meshkit.mock import MockConfig, MockWorkerThread


def create_app(mesh: Mesh | None = None) -> FastAPI:
    """The app; without a mesh, MeshMiddleware builds one with ``Mesh.from_env()``."""
    app = FastAPI(title="shop")

    @app.get("/hello")
    def hello() -> dict[str, str]:
        return {"hello": "from FastAPI"}

    # Pure ASGI middleware: inference paths never reach FastAPI's routing.
    app.add_middleware(MeshMiddleware, mesh=mesh)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()

    with contextlib.ExitStack() as stack:
        if os.environ.get("MESHKIT_WORKERS") or os.environ.get("MESHKIT_CONFIG"):
            mesh = Mesh.from_env()
        else:
            mocks = [
                stack.enter_context(MockWorkerThread(MockConfig(name=f"w{i}", output_tokens=6)))
                for i in range(2)
            ]
            mesh = Mesh(workers=[m.url for m in mocks], policy="round_robin")
            print("mock workers:", ", ".join(m.url for m in mocks))
        stack.enter_context(mesh)  # closes the prepare pool on the way out
        base = f"http://127.0.0.1:{args.port}"
        print(f"try:  curl {base}/hello")
        print(
            f"      curl {base}/v1/chat/completions -H 'content-type: application/json' "
            """-d '{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'""",
            flush=True,
        )
        # Ctrl+C stops the server gracefully; the mocks and the mesh close after it.
        with contextlib.suppress(KeyboardInterrupt):
            uvicorn.run(create_app(mesh), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
