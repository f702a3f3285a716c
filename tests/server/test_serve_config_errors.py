"""Configuration errors: exit code 2 and one line on stderr naming the key at fault.

The issue's four cases (bad TOML, unknown key, bad URL, missing environment
variable) run the command as a subprocess; the other cases call the same
``main()`` in-process, which is quicker and reaches the same code.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from meshkit.server.cli import main

SUBPROCESS = {"bad_toml", "unknown_key", "bad_url_in_file", "bad_url_flag", "missing_env_var"}

CASES = {
    "bad_toml": ("policy = \n", [], "'toml'"),
    "unknown_key": ("polcy = 'round_robin'\n", [], "'polcy'"),
    "unknown_section_key": ("[prepare]\nqueue_cap = 3\n", [], "'prepare.queue_cap'"),
    "wrong_type": ("[prepare]\nworkers = 'two'\n", [], "'prepare.workers'"),
    "bad_url_in_file": ("[[workers]]\nurl = 'ftp://x'\n", [], "'workers.url'"),
    "missing_env_var": (
        "[[workers]]\nurl = 'http://127.0.0.1:9'\napi_key_env = 'MESHKIT_TEST_UNSET_KEY'\n",
        [],
        "'workers.api_key_env'",
    ),
    "bad_url_flag": ("", ["--worker", "not a url"], "'workers.url' (--worker)"),
    "bad_label_flag": ("", ["--worker", "http://127.0.0.1:9#mesh.apis"], "'workers.labels'"),
    "unknown_api_label": ("", ["--worker", "http://h:1#mesh.apis=chat,nope"], "mesh.apis"),
    "unknown_policy": ("", ["--worker", "http://127.0.0.1:9", "--policy", "nope"], "'policy'"),
    "bad_port": ("", ["--port", "70000"], "'server.port' (--port)"),
    "bad_log_level_in_file": ("[server]\nlog_level = 'loud'\n", [], "'server.log_level'"),
}


def run_main(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> subprocess.CompletedProcess[str]:
    rc = main(args)
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, rc, out, err)


@pytest.mark.parametrize("case", CASES)
def test_config_error_is_one_line_and_exit_2(
    case: str,
    tmp_path: Path,
    meshkit_run: Any,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    toml, flags, key = CASES[case]
    args = ["serve", *flags]
    if toml:
        path = tmp_path / "meshkit.toml"
        path.write_text(toml)
        args += ["--config", str(path)]
    if case in SUBPROCESS:
        p = meshkit_run(*args)
    else:
        for var in ("MESHKIT_CONFIG", "MESHKIT_WORKERS", "MESHKIT_POLICY"):
            monkeypatch.delenv(var, raising=False)
        p = run_main(args, capsys)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("meshkit: error: config key ")
    assert key in lines[0]
    if toml:
        assert str(tmp_path / "meshkit.toml") in lines[0]  # the file is named too
    assert p.stdout == ""


def test_missing_config_file_names_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    p = run_main(["serve", "--config", str(tmp_path / "absent.toml")], capsys)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        f"meshkit: error: config key '--config': no such file: {tmp_path / 'absent.toml'}"
    ]


def test_meshkit_config_from_the_environment_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "env.toml"
    path.write_text("bogus = 1\n")
    monkeypatch.setenv("MESHKIT_CONFIG", str(path))
    p = run_main(["serve"], capsys)
    assert p.returncode == 2
    assert "'bogus'" in p.stderr and str(path) in p.stderr


@pytest.mark.parametrize("args", [["serve", "--port", "eighty"], ["nonsense"], []])
def test_usage_errors_exit_2(args: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
