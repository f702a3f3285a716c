"""Reload and discovery through a real ``meshkit serve``: SIGHUP, the workers file,
``dns://`` entries (``docs/configuration.md``, "Reload and discovery")."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx2
import pytest

from harness import wait_until
from meshkit.mock import MockConfig, MockWorkerThread

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
FAST = "[lifecycle]\nhealth_interval_s = 0.2\n"


def _worker_of(gw: Any) -> str:
    r = httpx2.post(gw.url + "/v1/chat/completions", json=CHAT, trust_env=False, timeout=10)
    assert r.status_code == 200, r.text
    return r.headers["x-mock-worker"]


def _fleet(gw: Any) -> dict[str, dict[str, Any]]:
    r = httpx2.get(gw.url + "/workers", trust_env=False, timeout=10)
    return {w["url"]: w for w in r.json()["workers"]}


def _ready(gw: Any) -> bool:
    return httpx2.get(gw.url + "/readiness", trust_env=False).status_code == 200


def _logged(gw: Any, text: str) -> list[str]:
    return [line for line in list(gw.stderr) if text in line]


def _metric(gw: Any, name: str) -> dict[str, float]:
    text = httpx2.get(gw.url + "/metrics", trust_env=False).text
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(rf'^{name}\{{[a-z]+="([a-z]+)"\}} (\S+)$', text, re.M)
    }


def test_sighup_applies_workers_labels_and_policy_and_drains_the_removed(
    mock_factory: Any, spawn: Any, tmp_path: Path
) -> None:
    a = mock_factory(name="a", per_token_ms=100.0, output_tokens=15)
    b = mock_factory(name="b")
    conf = tmp_path / "meshkit.toml"
    conf.write_text(f'policy = "round_robin"\n{FAST}[[workers]]\nurl = "{a.url}"\n')
    gw = spawn("serve", "--config", str(conf), "--port", "0")
    assert wait_until(lambda: _ready(gw))
    assert _worker_of(gw) == "a"

    stream = {**CHAT, "stream": True}
    with (
        httpx2.Client(trust_env=False, timeout=30) as client,
        client.stream("POST", gw.url + "/v1/chat/completions", json=stream) as r,
    ):
        chunks = r.iter_bytes()
        body = next(chunks)  # a's stream is in flight when a leaves the file
        conf.write_text(
            f'policy = "power_of_two"\n{FAST}[[workers]]\nurl = "{b.url}"\n'
            'labels = { "zone" = "east" }\n'
        )
        gw.signal(signal.SIGHUP)
        assert wait_until(lambda: bool(_logged(gw, "reloaded:")))
        # At once: a drains (no new placement), b takes the traffic.
        assert _worker_of(gw) == "b"
        fleet = _fleet(gw)
        assert fleet[b.url]["labels"] == {"zone": "east"}
        assert fleet[a.url]["state"] == "draining"
        body += b"".join(chunks)
    events = [x for x in body.decode().splitlines() if x.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert sum("tok" in e for e in events) == 15  # the drained stream ran to its end
    assert wait_until(lambda: a.url not in _fleet(gw))  # then a was removed
    (line,) = _logged(gw, "reloaded:")
    assert "1 added, 0 updated, 1 removed" in line and "policy rebuilt" in line

    # A label change on a worker that stays: swapped in place, no drain.
    conf.write_text(
        f'policy = "power_of_two"\n{FAST}[[workers]]\nurl = "{b.url}"\n'
        'labels = { "zone" = "west" }\n'
    )
    gw.signal(signal.SIGHUP)
    assert wait_until(lambda: len(_logged(gw, "reloaded:")) == 2)
    assert "0 added, 1 updated, 0 removed" in _logged(gw, "reloaded:")[1]
    assert "policy unchanged" in _logged(gw, "reloaded:")[1]
    assert _fleet(gw)[b.url]["labels"] == {"zone": "west"}

    # A file that does not load: one line naming the key, the running config stays.
    conf.write_text(f'policy = "power_of_two"\npolcy = "x"\n[[workers]]\nurl = "{a.url}"\n')
    gw.signal(signal.SIGHUP)
    assert wait_until(lambda: bool(_logged(gw, "reload refused")))
    (refused,) = _logged(gw, "reload refused")
    assert "'polcy'" in refused and str(conf) in refused
    assert gw.popen.poll() is None
    assert list(_fleet(gw)) == [b.url]
    assert _worker_of(gw) == "b"
    assert _metric(gw, "mesh_router_reloads_total") == {"ok": 2.0, "error": 1.0}

    gw.signal(signal.SIGTERM)
    rc, err = gw.wait()
    assert rc == 0, err
    assert "Traceback" not in err


def test_workers_file_is_watched(mock_factory: Any, spawn: Any, tmp_path: Path) -> None:
    a = mock_factory(name="a")
    b = mock_factory(name="b")
    fleet_file = tmp_path / "fleet.json"
    fleet_file.write_text(json.dumps({"workers": [{"url": a.url}]}))
    conf = tmp_path / "meshkit.toml"
    # Relative: to the config file's folder.
    conf.write_text(f'workers_file = "fleet.json"\n{FAST}[discovery]\nwatch_interval_s = 0.1\n')
    gw = spawn("serve", "--config", str(conf), "--port", "0", "--policy", "round_robin")
    assert wait_until(lambda: _ready(gw))
    assert list(_fleet(gw)) == [a.url]

    # The way a ConfigMap changes: a new file renamed over the old one.
    staged = tmp_path / "fleet.json.new"
    staged.write_text(json.dumps({"workers": [{"url": a.url}, {"url": b.url}]}))
    os.replace(staged, fleet_file)
    assert wait_until(lambda: set(_fleet(gw)) == {a.url, b.url})
    assert wait_until(lambda: {_worker_of(gw) for _ in range(4)} == {"a", "b"})

    # Half-written or wrong: the last good list stays, one line says why.
    fleet_file.write_text('{"workers": [{"url": ')
    assert wait_until(lambda: bool(_logged(gw, "keeping its last workers")))
    assert set(_fleet(gw)) == {a.url, b.url}

    fleet_file.write_text(json.dumps([{"url": b.url}]))
    assert wait_until(lambda: list(_fleet(gw)) == [b.url])
    assert {_worker_of(gw) for _ in range(4)} == {"b"}
    assert len(_logged(gw, "keeping its last workers")) == 1
    assert _logged(gw, "read again")
    assert _metric(gw, "mesh_router_discovery_failures_total") == {"file": 1.0}


def _can_remount_hosts() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = "mount --bind /dev/null /etc/hosts"
    cmd = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", probe]
    return subprocess.run(cmd, capture_output=True, check=False).returncode == 0


@pytest.mark.skipif(
    sys.platform != "linux" or not _can_remount_hosts(),
    reason="needs user and mount namespaces (unshare) to give the gateway its own /etc/hosts",
)
def test_dns_entry_follows_what_the_name_resolves_to(spawn: Any, tmp_path: Path) -> None:
    # The gateway runs with its own /etc/hosts (a bind mount in a private mount
    # namespace), so the system resolver (getaddrinfo) answers what the test writes:
    # the way a headless Service's records follow its pods.
    first = MockWorkerThread(MockConfig(name="pod2"), host="127.0.0.2")
    first.start()
    port = first.worker.port
    second = MockWorkerThread(MockConfig(name="pod3"), host="127.0.0.3", port=port)
    second.start()
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.2 workers.meshkit.test\n")
    conf = tmp_path / "meshkit.toml"
    conf.write_text(
        f"{FAST}[discovery]\nresolve_timeout_s = 1.0\n[[workers]]\n"
        f'url = "dns://workers.meshkit.test:{port}"\n'
        'labels = { "pool" = "chat" }\n'
    )
    script = f'mount --bind "{hosts}" /etc/hosts && exec "$@"'
    into = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh"]
    gw = spawn("serve", "--config", str(conf), "--port", "0", prefix=tuple(into))
    pod2, pod3 = f"http://127.0.0.2:{port}", f"http://127.0.0.3:{port}"
    try:
        assert wait_until(lambda: _ready(gw))
        assert list(_fleet(gw)) == [pod2]
        assert _fleet(gw)[pod2]["labels"] == {"pool": "chat"}

        # Written in place: a bind-mounted file keeps its inode.
        hosts.write_text("127.0.0.2 workers.meshkit.test\n127.0.0.3 workers.meshkit.test\n")
        assert wait_until(lambda: set(_fleet(gw)) == {pod2, pod3})
        assert wait_until(lambda: {_worker_of(gw) for _ in range(6)} == {"pod2", "pod3"})

        hosts.write_text("127.0.0.3 workers.meshkit.test\n")
        assert wait_until(lambda: list(_fleet(gw)) == [pod3])
        assert {_worker_of(gw) for _ in range(4)} == {"pod3"}

        # The name stops resolving: the last answer stays, said once.
        hosts.write_text("")
        assert wait_until(lambda: bool(_logged(gw, "lookup failed")))
        assert list(_fleet(gw)) == [pod3]
        assert _worker_of(gw) == "pod3"
        gw.signal(signal.SIGTERM)
        rc, err = gw.wait()
        assert rc == 0, err
        assert len(_logged(gw, "lookup failed")) == 1
    finally:
        first.stop()
        second.stop()
