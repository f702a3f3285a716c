"""
meshkit inside FastAPI: ``app.add_middleware(MeshMiddleware, mesh=mesh)`` on a FastAPI
app with a route of its own (the inference paths never reach FastAPI's router).

``MESHBENCH_WORKERS=... uvicorn --app-dir benchmarks/frontends meshkit_fastapi:app``
"""

from __future__ import annotations

from _env import mesh_kwargs
from fastapi import FastAPI

from meshkit import Mesh
from meshkit.frontends.asgi import MeshMiddleware

app = FastAPI()
app.add_middleware(MeshMiddleware, mesh=Mesh(**mesh_kwargs()))


@app.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}
