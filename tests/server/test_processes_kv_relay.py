"""``meshkit serve --processes N`` and the engines' KV events, through real processes:
the children take them through one relay child (one subscription per engine, not
one per child), every child's index fills, a killed relay comes back and the
children follow it again, and the relay is left out when it has nothing to do."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")

from conformance.test_kv_routing import TOKENIZER, publishing_worker  # noqa: E402
from harness import wait_until  # noqa: E402
from server.test_processes import (  # noqa: E402
    _alive,
    _client_of,
    _place_of,
    children_of,
    fresh,
    processes_seen,
)

TCP_ESTABLISHED = "01"


def established_to(port: int) -> int:
    """TCP connections established to ``port`` on this host (its accepting side)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, _remote, state = line.split()[1:4]
            if state == TCP_ESTABLISHED and int(local.rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


def gateway(spawn: Any, tmp_path: Path, worker: Any, extra: str = "") -> Any:
    """``serve --processes 2`` of ``worker`` (``extra``: more of the config file), ready."""
    cfg = tmp_path / "meshkit.toml"
    cfg.write_text(
        f'policy = "cache_aware"\ntokenizer = "{TOKENIZER}"\n\n'
        f'[[workers]]\nurl = "{worker.url}"\nkv_events = "{worker.kv_events_endpoint}"\n'
        f'kv_replay = "{worker.kv_replay_endpoint}"\n{extra}'
    )
    gw = spawn("serve", "--config", str(cfg), "--port", "0", "--processes", "2")
    assert wait_until(lambda: fresh(gw.url, path="/readiness").status_code == 200, timeout=60)
    return gw


def chat(url: str, topic: str) -> None:
    body = {"model": "mock-model", "messages": [{"role": "user", "content": f"tell me of {topic}"}]}
    r = fresh(url, "POST", "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


def blocks_of(url: str, process: int) -> tuple[str | None, int]:
    """Process ``process``'s match kind and KV blocks for the one worker."""
    with _client_of(url, process) as c:
        row = c.get(url + "/workers").json()["workers"][0]
    return row.get("prefix_match"), int(row.get("kv_blocks") or 0)


def every_process_holds_more_than(url: str, floor: int) -> bool:
    return all(
        kind == "events" and blocks > floor for kind, blocks in (blocks_of(url, p) for p in (0, 1))
    )


def metric(text: str, name: str, label: str = "") -> float:
    """The sum of ``name``'s samples whose labels hold ``label``."""
    values = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " ") and label in line
    ]
    assert values, f"no {name} {label} in the scrape"
    return sum(values)


def relay_child(parent: int) -> int | None:
    for pid in children_of(parent):
        if _alive(pid) and _place_of(pid).get("role") == "kv-relay":
            return pid
    return None


@pytest.mark.parametrize(("relay", "subscriptions"), [(True, 1), (False, 2)])
def test_the_children_subscribe_once_per_engine_through_their_relay(
    mock_factory: Any, spawn: Any, tmp_path: Path, relay: bool, subscriptions: int
) -> None:
    worker = publishing_worker(mock_factory)
    gw = gateway(spawn, tmp_path, worker, "" if relay else "\n[server]\nkv_relay = false\n")
    parent = gw.popen.pid
    assert wait_until(lambda: len(children_of(parent)) == 2 + relay)
    assert (relay_child(parent) is not None) == relay
    assert wait_until(lambda: processes_seen(gw.url, 20) == {0, 1}, timeout=60)
    assert worker.kv_events_endpoint is not None  # a publishing mock
    port = int(worker.kv_events_endpoint.rsplit(":", 1)[1])
    assert wait_until(lambda: established_to(port) == subscriptions, timeout=30)
    for topic in ("rivers", "mountains", "deserts", "forests"):
        chat(gw.url, topic)
    # What one child placed reaches the other's index too: the engine's events.
    assert wait_until(lambda: every_process_holds_more_than(gw.url, 0), timeout=30)
    assert established_to(port) == subscriptions
    # One /metrics: the relay's counts are in it, and it is not a router process.
    text = fresh(gw.url, path="/metrics").text
    assert metric(text, "mesh_gateway_processes_up") == 2
    if relay:
        assert metric(text, "mesh_gateway_kv_relay_up") == 1
        assert metric(text, "mesh_kv_relay_messages_total", 'outcome="forwarded"') > 0
        assert metric(text, "mesh_kv_relay_connected", 'process="kv-relay"') == 1
    else:
        assert "mesh_gateway_kv_relay_up" not in text
        assert "mesh_kv_relay_messages" not in text


def test_a_killed_relay_comes_back_and_the_children_follow_it(
    mock_factory: Any, spawn: Any, tmp_path: Path
) -> None:
    gw = gateway(spawn, tmp_path, publishing_worker(mock_factory))
    parent = gw.popen.pid
    assert wait_until(lambda: relay_child(parent) is not None)
    chat(gw.url, "rivers")
    assert wait_until(lambda: every_process_holds_more_than(gw.url, 0), timeout=30)
    before = max(blocks_of(gw.url, p)[1] for p in (0, 1))
    victim = relay_child(parent)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    assert wait_until(lambda: relay_child(parent) not in (None, victim), timeout=60)
    # The routers kept serving meanwhile, and new blocks reach both indexes.
    for topic in ("a long way to the sea", "the mountains far away", "the deserts of the south"):
        chat(gw.url, topic)
    assert wait_until(lambda: every_process_holds_more_than(gw.url, before), timeout=60)
    err = "".join(gw.stderr)
    assert "the KV-event relay exited with code -9" in err and "restarting" in err


def test_sighup_brings_a_new_engine_to_the_relay_and_every_child(
    mock_factory: Any, spawn: Any, tmp_path: Path
) -> None:
    first, second = publishing_worker(mock_factory), publishing_worker(mock_factory)
    gw = gateway(spawn, tmp_path, first)
    assert wait_until(lambda: relay_child(gw.popen.pid) is not None)
    cfg = tmp_path / "meshkit.toml"
    cfg.write_text(
        cfg.read_text()
        + f'\n[[workers]]\nurl = "{second.url}"\n'
        + f'kv_events = "{second.kv_events_endpoint}"\n'
        + f'kv_replay = "{second.kv_replay_endpoint}"\n'
    )
    gw.signal(signal.SIGHUP)
    assert second.kv_events_endpoint is not None  # a publishing mock
    port = int(second.kv_events_endpoint.rsplit(":", 1)[1])
    # the relay subscribes to the new engine, once for the gateway
    assert wait_until(lambda: established_to(port) == 1, timeout=30)

    def both_on_events() -> bool:
        for p in (0, 1):
            with _client_of(gw.url, p) as c:
                rows = c.get(gw.url + "/workers").json()["workers"]
            if [r.get("prefix_match") for r in rows] != ["events", "events"]:
                return False
        return True

    assert wait_until(both_on_events, timeout=30)
    assert established_to(port) == 1


def test_a_worker_an_admin_adds_is_followed_by_the_relay_once(
    mock_factory: Any, spawn: Any, tmp_path: Path
) -> None:
    first, second = publishing_worker(mock_factory), publishing_worker(mock_factory, "b")
    gw = gateway(spawn, tmp_path, first)
    assert wait_until(lambda: relay_child(gw.popen.pid) is not None)
    spec = {
        "url": second.url,
        "kv_events": second.kv_events_endpoint,
        "kv_replay": second.kv_replay_endpoint,
    }
    r = fresh(gw.url, "POST", "/workers", json=spec)
    assert r.status_code == 201, r.text
    assert r.json()["processes"]["applied"] == 2
    assert second.kv_events_endpoint is not None  # a publishing mock
    port = int(second.kv_events_endpoint.rsplit(":", 1)[1])
    # no worker of the relay's configuration names it: it follows the children
    assert wait_until(lambda: established_to(port) == 1, timeout=30)
    served_by_second = 0
    for i in range(64):  # new prompts until the new worker has stored blocks
        content = f"question {i} of the sea and its rivers"
        body = {"model": "mock-model", "messages": [{"role": "user", "content": content}]}
        r = fresh(gw.url, "POST", "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        served_by_second += r.headers["x-mock-worker"] == "b"
        if served_by_second >= 2:
            break
    assert served_by_second >= 2

    def blocks_on_second(p: int) -> int:
        with _client_of(gw.url, p) as c:
            rows = c.get(gw.url + "/workers").json()["workers"]
        return sum(int(r.get("kv_blocks") or 0) for r in rows if r["url"] == second.url)

    assert wait_until(lambda: all(blocks_on_second(p) > 0 for p in (0, 1)), timeout=30)
    assert established_to(port) == 1


def test_a_relay_of_the_operators_own_means_none_of_the_gateways(
    mock_factory: Any, spawn: Any, tmp_path: Path
) -> None:
    worker = publishing_worker(mock_factory)
    gw = gateway(spawn, tmp_path, worker, '\n[kv]\nrelay = "tcp://127.0.0.1:9"\n')
    parent = gw.popen.pid
    assert wait_until(lambda: len(children_of(parent)) == 2)
    assert relay_child(parent) is None
    # the engine itself is never subscribed to: the children wait on that relay
    assert worker.kv_events_endpoint is not None  # a publishing mock
    port = int(worker.kv_events_endpoint.rsplit(":", 1)[1])
    assert established_to(port) == 0


def test_a_run_directory_too_long_for_its_unix_sockets_is_one_clear_error(
    meshkit_run: Any, tmp_path: Path
) -> None:
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    done = meshkit_run(
        "serve",
        "--worker",
        "http://127.0.0.1:9",
        "--port",
        "0",
        "--processes",
        "2",
        TMPDIR=str(deep),
    )
    assert done.returncode == 2, done.stderr
    assert "too long a path for a Unix socket" in done.stderr and "TMPDIR" in done.stderr
    assert done.stderr.count("\n") == 1
    assert os.listdir(deep) == []


def test_the_relay_does_not_outlive_a_killed_parent(
    mock_factory: Any, spawn: Any, tmp_path: Path
) -> None:
    parent = gateway(spawn, tmp_path, publishing_worker(mock_factory)).popen.pid
    assert wait_until(lambda: len(children_of(parent)) == 3)
    kids = children_of(parent)
    run_dir = Path(_place_of(kids[0])["run_dir"])
    assert (run_dir / "kv.pub").exists()
    os.kill(parent, signal.SIGKILL)
    assert wait_until(lambda: not any(_alive(k) for k in kids), timeout=60)
    # whichever child left last removed the directory, the relay's sockets too
    assert wait_until(lambda: not run_dir.exists(), timeout=10)
