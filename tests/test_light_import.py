"""``import meshkit`` is light: no HTTP client, tokenizer, template engine or WSGI
library until a mode that needs it is built (checked in a fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY: tuple[str, ...] = (
    "httpx",
    "httpx2",
    "httpcore",
    "httpcore2",
    "aiohttp",
    "tokenizers",
    "tiktoken",
)
HEAVY += ("jinja2", "werkzeug", "uvicorn", "granian")


def loaded_after(code: str) -> set[str]:
    """The heavy modules loaded once ``code`` ran in a new interpreter."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    modules = set(json.loads(out.stdout.strip().splitlines()[-1]))
    return {m for m in HEAVY if m in modules}


def test_import_meshkit_loads_none_of_them() -> None:
    assert loaded_after("import meshkit") == set()


def test_a_mesh_and_the_plugin_api_load_none_of_them() -> None:
    code = (
        "import meshkit\n"
        "from meshkit import Candidate, RequestView\n"
        "from meshkit.policies import BasePolicy, PlacementContext\n"
        "mesh = meshkit.Mesh(workers=['http://127.0.0.1:9'], prepare={'workers': 1})\n"
        "mesh.close()"
    )
    assert loaded_after(code) == set()


def test_the_asgi_middleware_loads_no_client_library() -> None:
    code = (
        "import meshkit\n"
        "mesh = meshkit.Mesh(workers=['http://127.0.0.1:9'], prepare={'workers': 1})\n"
        "mw = meshkit.MeshMiddleware(lambda s, r, w: None, mesh=mesh)\n"
        "mesh.close()"
    )
    assert loaded_after(code) == set()


@pytest.mark.parametrize(
    ("code", "needed"),
    [
        ("from meshkit import MeshWSGIMiddleware", {"werkzeug"}),
        ("from meshkit.prepare.templates import render_chat_template", {"jinja2"}),
    ],
)
def test_a_mode_loads_only_what_it_needs(code: str, needed: set[str]) -> None:
    assert loaded_after(code) == needed
