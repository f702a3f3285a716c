"""Settings precedence for ``meshkit serve``: flags over file over environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshkit.errors import ConfigError
from meshkit.server.settings import resolve_settings

FILE = """
policy = "least_load"
[server]
port = 9100
grace_s = 3.5
access_log = true
[[workers]]
url = "http://file:1"
"""


@pytest.fixture
def toml(tmp_path: Path) -> str:
    path = tmp_path / "meshkit.toml"
    path.write_text(FILE)
    return str(path)


ENV = {"MESHKIT_WORKERS": "http://env:1,http://env:2#mesh.apis=chat", "MESHKIT_POLICY": "random"}


def urls(config: object) -> list[str]:
    return [w.url for w in config.workers]  # type: ignore[attr-defined]


def test_defaults() -> None:
    config, s = resolve_settings(environ={})
    assert config.workers == () and config.policy == "round_robin"
    assert (s.host, s.port, s.grace_s, s.log_level, s.access_log) == (
        "127.0.0.1",
        8080,
        30.0,
        "info",
        False,
    )


def test_environment_only() -> None:
    config, _ = resolve_settings(environ=ENV)
    assert urls(config) == ["http://env:1", "http://env:2"]
    assert config.workers[1].labels == {"mesh.apis": "chat"}
    assert config.policy == "random"


def test_file_over_environment(toml: str) -> None:
    config, s = resolve_settings(config=toml, environ=ENV)
    assert urls(config) == ["http://file:1"]
    assert config.policy == "least_load"
    assert (s.port, s.grace_s, s.access_log) == (9100, 3.5, True)


def test_meshkit_config_names_the_file(toml: str) -> None:
    config, _ = resolve_settings(environ={"MESHKIT_CONFIG": toml})
    assert urls(config) == ["http://file:1"]


def test_environment_fills_what_the_file_leaves_out(tmp_path: Path) -> None:
    path = tmp_path / "bare.toml"
    path.write_text("[server]\nport = 1\n")
    config, _ = resolve_settings(config=str(path), environ=ENV)
    assert urls(config) == ["http://env:1", "http://env:2"]
    assert config.policy == "random"


def test_flags_over_file(toml: str) -> None:
    config, s = resolve_settings(
        config=toml,
        workers=["http://flag:1#mesh.model=m"],
        policy="power_of_two",
        port=0,
        grace_s=0.0,
        access_log=None,
        log_level="DEBUG",
        environ=ENV,
    )
    assert urls(config) == ["http://flag:1"]
    assert config.workers[0].model == "m"
    assert config.policy == "power_of_two"
    assert (s.port, s.grace_s, s.access_log, s.log_level) == (0, 0.0, True, "debug")


def test_negative_grace_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"server\.grace_s"):
        resolve_settings(grace_s=-1.0, environ={})


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ("max_pipelined = 0", "server.max_pipelined"),
        ("max_connections = 0", "server.max_connections"),
        ("keep_alive_s = 0", "server.keep_alive_s"),
    ],
)
def test_server_bounds_below_one_are_refused(tmp_path: Path, line: str, key: str) -> None:
    path = tmp_path / "bounds.toml"
    path.write_text(f"[server]\n{line}\n")
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        resolve_settings(config=str(path), environ={})


def test_server_bounds_come_from_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bounds.toml"
    path.write_text("[server]\nmax_pipelined = 4\nmax_connections = 9\n")
    _, s = resolve_settings(config=str(path), environ={})
    assert (s.max_pipelined, s.max_connections) == (4, 9)


def test_the_processes_kv_relay_is_on_unless_the_file_turns_it_off(tmp_path: Path) -> None:
    assert resolve_settings(environ={})[1].kv_relay is True
    path = tmp_path / "relay.toml"
    path.write_text("[server]\nkv_relay = false\n")
    assert resolve_settings(config=str(path), environ={})[1].kv_relay is False
    path.write_text('[server]\nkv_relay = "no"\n')
    with pytest.raises(ConfigError, match=r"server\.kv_relay.*true or false"):
        resolve_settings(config=str(path), environ={})
