"""dns:// worker entries, the workers file and ``[discovery]`` in :mod:`meshkit.config`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshkit.config import DiscoveryConfig, MeshConfig, load_workers_file
from meshkit.core.discovery import DnsWorkers
from meshkit.errors import ConfigError
from meshkit.server.settings import resolve_settings

SECRET = "sk-dns-SECRET"


def test_dns_entries_go_apart_from_the_static_workers(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text(
        '[[workers]]\nurl = "http://a:1"\n'
        f'[[workers]]\nurl = "dns://svc:8000"\napi_key = "{SECRET}"\n'
        'labels = { "mesh.model" = "m" }\n'
    )
    c = MeshConfig.from_file(path)
    assert [w.url for w in c.workers] == ["http://a:1"]
    (e,) = c.dns_workers
    assert (e.name, e.port, e.api_key, dict(e.labels)) == ("svc", 8000, SECRET, {"mesh.model": "m"})
    assert SECRET not in repr(c)


def test_dns_entries_from_the_environment_and_flags() -> None:
    env = {"MESHKIT_WORKERS": "http://a:1,dns://svc:80#mesh.apis=chat,completions"}
    c = MeshConfig.from_env(env)
    assert [w.url for w in c.workers] == ["http://a:1"]
    assert [(e.source, dict(e.labels)) for e in c.dns_workers] == [
        ("dns://svc:80", {"mesh.apis": "chat,completions"})
    ]
    flags, _ = resolve_settings(workers=["dns://other:81"], environ=env)
    assert flags.workers == () and [e.source for e in flags.dns_workers] == ["dns://other:81"]
    envd, _ = resolve_settings(environ=env)
    assert [e.source for e in envd.dns_workers] == ["dns://svc:80"]


def test_dns_entries_take_no_tls_options() -> None:
    with pytest.raises(ConfigError, match="plain http"):
        MeshConfig.build(workers=[{"url": "dns://svc:80", "tls_ca_file": "/ca.pem"}])


def test_dns_entry_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DNS_KEY", SECRET)
    c = MeshConfig.build(workers=[{"url": "dns://svc:80", "api_key_env": "DNS_KEY"}])
    assert c.dns_workers[0].api_key == SECRET


def test_workers_file_is_relative_to_the_config_file(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    path = tmp_path / "conf" / "m.toml"
    path.write_text('workers_file = "fleet.toml"\n')
    assert MeshConfig.from_file(path).workers_file == str(tmp_path / "conf" / "fleet.toml")
    path.write_text('workers_file = "/etc/meshkit/fleet.toml"\n')
    assert MeshConfig.from_file(path).workers_file == "/etc/meshkit/fleet.toml"
    with pytest.raises(ConfigError, match="workers_file"):
        MeshConfig.build(workers_file=3)


def test_workers_file_formats(tmp_path: Path) -> None:
    toml = tmp_path / "f.toml"
    toml.write_text('[[workers]]\nurl = "http://a:1"\n[[workers]]\nurl = "dns://svc:80"\n')
    ws, dns = load_workers_file(toml, 1 << 20)
    assert [w.url for w in ws] == ["http://a:1"] and [e.source for e in dns] == ["dns://svc:80"]
    for data in ({"workers": ["http://a:1"]}, [{"url": "http://a:1", "labels": {"z": "1"}}]):
        j = tmp_path / "f.json"
        j.write_text(json.dumps(data))
        ws, dns = load_workers_file(j, 1 << 20)
        assert [w.url for w in ws] == ["http://a:1"] and dns == ()


@pytest.mark.parametrize(
    ("name", "text", "key"),
    [
        ("f.toml", "[[workers]\n", "'workers_file'"),
        ("f.json", '{"workers": [', "'workers_file'"),
        ("f.toml", 'policy = "x"\n', "'policy'"),
        ("f.json", '{"workers": "http://a:1"}', "'workers'"),
        ("f.toml", '[[workers]]\nurl = "ftp://a"\n', "'workers.url'"),
        ("f.toml", '[[workers]]\nurl = "http://a:1"\nlabel = {}\n', "'workers[0].label'"),
        ("f.toml", b"\xff\xfe", "'workers_file'"),
    ],
)
def test_a_bad_workers_file_names_the_key_and_the_file(
    tmp_path: Path, name: str, text: str | bytes, key: str
) -> None:
    p = tmp_path / name
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_workers_file(p, 1 << 20)
    assert key in str(info.value) and str(p) in str(info.value)


def test_workers_file_size_is_bounded(tmp_path: Path) -> None:
    p = tmp_path / "f.toml"
    p.write_text('[[workers]]\nurl = "http://a:1"\n')
    size = p.stat().st_size
    assert load_workers_file(p, size)[0]
    with pytest.raises(ConfigError, match=r"discovery\.max_file_bytes"):
        load_workers_file(p, size - 1)
    with pytest.raises(ConfigError, match="cannot read"):
        load_workers_file(tmp_path / "missing.toml", 10)


@pytest.mark.parametrize(
    ("key", "value"),
    [("max_addresses", 0), ("resolve_timeout_s", 0.0), ("watch_interval_s", 0.0)],
)
def test_discovery_bounds_are_checked(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"discovery\.{key}"):
        MeshConfig.build(discovery={key: value})


def test_discovery_defaults() -> None:
    d = MeshConfig().discovery
    assert d == DiscoveryConfig()
    assert (d.max_addresses, d.max_file_bytes) == (256, 1024 * 1024)


def test_dns_workers_are_bounded_per_entry() -> None:
    e = MeshConfig.build(workers=["dns://svc:80"], discovery={"max_addresses": 3}).dns_workers[0]
    assert isinstance(e, DnsWorkers)
    answer = [f"10.0.0.{i}" for i in range(10)]
    assert len(e.workers(answer, limit=3)) == 3
