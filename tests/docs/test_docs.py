"""Every code block in README.md and docs/ is run or checked.

- ``python`` blocks run, each in a fresh namespace (blocks that need a live
  worker start their own mock worker);
- ``toml`` blocks load as a meshkit configuration; ``json`` blocks parse;
- ``bash`` / ``console`` blocks: every ``meshkit`` command line names a real
  subcommand and only flags that subcommand's ``--help`` lists;
- ``text`` blocks are diagrams and are not run.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from meshkit.config import MeshConfig

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks() -> list[tuple[str, str, str]]:
    out = []
    for path in DOCS:
        for i, m in enumerate(FENCE.finditer(path.read_text(encoding="utf-8"))):
            out.append((f"{path.relative_to(ROOT)}#{i}", m.group(1) or "text", m.group(2)))
    return out


BLOCKS = _blocks()


def _ids(kind: str) -> list[tuple[str, str]]:
    return [(name, code) for name, lang, code in BLOCKS if lang == kind]


@pytest.mark.parametrize(("name", "code"), _ids("python"), ids=lambda v: v if "#" in v else "")
def test_python_blocks_run(name: str, code: str) -> None:
    namespace: dict[str, object] = {"__name__": f"doc:{name}"}
    exec(compile(code, name, "exec"), namespace)
    mesh = namespace.get("mesh")
    close = getattr(mesh, "close", None)
    if callable(close):
        close()


@pytest.mark.parametrize(("name", "code"), _ids("toml"), ids=lambda v: v if "#" in v else "")
def test_toml_blocks_are_valid_config(
    name: str, code: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for env in re.findall(r'api_key_env\s*=\s*"(\w+)"', code):
        monkeypatch.setenv(env, "doc-test-key")
    data = tomllib.loads(code)
    if "project" in data or "build-system" in data:
        return  # a plugin's pyproject.toml: valid TOML is all there is to check
    MeshConfig.build(source=name, **data)


@pytest.mark.parametrize(("name", "code"), _ids("json"), ids=lambda v: v if "#" in v else "")
def test_json_blocks_parse(name: str, code: str) -> None:
    json.loads(code)


_HELP: dict[str, str] = {}


def _help(sub: str) -> str:
    if sub not in _HELP:
        proc = subprocess.run(
            [sys.executable, "-m", "meshkit", sub, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, f"meshkit {sub} --help failed: {proc.stderr}"
        _HELP[sub] = proc.stdout
    return _HELP[sub]


def _meshkit_lines() -> list[tuple[str, str]]:
    out = []
    for name, lang, code in BLOCKS:
        if lang not in ("bash", "console", "sh", "shell"):
            continue
        for line in code.splitlines():
            for part in re.split(r"&&|\|\|", line.lstrip("$ ")):
                part = part.strip()
                if part.startswith("meshkit ") or part.startswith("python -m meshkit "):
                    out.append((name, part))
    return out


@pytest.mark.parametrize(("name", "line"), _meshkit_lines(), ids=lambda v: v[:40])
def test_meshkit_command_lines_use_real_flags(name: str, line: str) -> None:
    words = shlex.split(line.split("#", 1)[0])
    words = words[words.index("meshkit") + 1 :]
    sub = words[0]
    text = _help(sub)
    for w in words[1:]:
        if w.startswith("--"):
            flag = w.split("=", 1)[0]
            assert flag in text, f"{name}: `meshkit {sub}` has no flag {flag}"


def test_configuration_reference_names_every_key() -> None:
    import dataclasses

    from meshkit.config import _SECTIONS, WorkerConfig

    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    sections = {**_SECTIONS, "workers": WorkerConfig, "": MeshConfig}
    for section, cls in sections.items():
        for f in dataclasses.fields(cls):
            if section == "" and f.name in _SECTIONS:
                continue
            assert f"`{f.name}`" in text, f"docs/configuration.md lacks [{section}] {f.name}"


def test_every_endpoint_is_listed_in_endpoints_md() -> None:
    from meshkit.core.endpoints import ENDPOINTS

    text = (ROOT / "docs" / "endpoints.md").read_text(encoding="utf-8")
    for e in ENDPOINTS:
        row = f"| `{'|'.join(sorted(e.methods))} {e.template}` | `{e.api.value}` |"
        assert row in text, row


def test_extproc_doc_shows_the_bootstrap_the_tests_use() -> None:
    pytest.importorskip("meshkit.testing.envoy")
    from meshkit.testing.envoy import bootstrap

    text = (ROOT / "docs" / "extproc.md").read_text(encoding="utf-8")
    blocks = [c for n, lang, c in BLOCKS if n.startswith("docs/extproc.md#") and lang == "json"]
    assert blocks, "docs/extproc.md lost its bootstrap"
    assert "receiving_namespaces" in text
    shown = json.loads(blocks[0])
    assert shown == bootstrap(listen_port=8080, extproc_port=9002, admin_port=9901)
