"""Workers' KV-event publishers (``kv_events``, ``kv_replay``) and ``[kv]`` in the config."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from meshkit.config import KvConfig, MeshConfig
from meshkit.core.discovery import same_worker
from meshkit.core.workers import Worker
from meshkit.errors import ConfigError


def test_a_workers_table_names_its_publisher(tmp_path: Path) -> None:
    path = tmp_path / "m.toml"
    path.write_text(
        '[[workers]]\nurl = "http://gpu-1:8000"\n'
        'kv_events = "tcp://{host}:5557"\nkv_replay = "tcp://{host}:5558"\n'
        '[[workers]]\nurl = "dns://vllm:8000"\nkv_events = "tcp://{host}:5557"\n'
        "[kv]\nmax_blocks_per_model = 5000\nreplay_timeout_s = 0.5\n"
    )
    c = MeshConfig.from_file(path)
    (w,) = c.workers
    assert (w.kv_events, w.kv_replay) == ("tcp://gpu-1:5557", "tcp://gpu-1:5558")
    (entry,) = c.dns_workers
    assert entry.worker("10.0.0.7").kv_events == "tcp://10.0.0.7:5557"  # per pod
    assert (c.kv.max_blocks_per_model, c.kv.replay_timeout_s) == (5000, 0.5)


@pytest.mark.parametrize(
    ("events", "replay", "key"),
    [
        ("http://gpu:5557", None, "workers.kv_events"),
        ("tcp://*:5557", None, "workers.kv_events"),  # vLLM binds that; meshkit connects
        ("tcp://", None, "workers.kv_events"),
        (None, "tcp://gpu:5558", "workers.kv_replay"),
    ],
)
def test_bad_endpoints_name_their_key(events: str | None, replay: str | None, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        Worker("http://gpu:8000", kv_events=events, kv_replay=replay)
    assert info.value.key == key


def test_a_new_publisher_is_a_change_to_apply() -> None:
    a = Worker("http://gpu:8000", kv_events="tcp://gpu:5557")
    assert same_worker(a, Worker("http://gpu:8000", kv_events="tcp://gpu:5557"))
    assert not same_worker(a, Worker("http://gpu:8000", kv_events="tcp://gpu:6000"))
    assert not same_worker(a, Worker("http://gpu:8000"))


@pytest.mark.parametrize(
    "values",
    [
        {"max_blocks_per_model": 0},
        {"match_tokens": 0},
        {"apply_batch": 0},
        {"apply_blocks": 0},
        {"max_lora_names": 0},
        {"max_worker_sets": 0},
        {"receive_hwm": 0},
        {"replay_timeout_s": 0.0},
        {"silence_s": -1.0},
        {"silence_s": float("nan")},
    ],
)
def test_kv_bounds_are_checked(values: dict[str, float]) -> None:
    with pytest.raises(ConfigError) as info:
        KvConfig(**values)  # type: ignore[arg-type]
    assert info.value.key == "kv." + next(iter(values))


def test_the_kv_bounds_reach_the_index() -> None:
    from meshkit import Mesh

    mesh = Mesh(
        workers=["http://127.0.0.1:9"],
        kv={"max_lora_names": 3, "max_blocks_per_model": 77, "max_worker_sets": 5},
    )
    kv = mesh.router.fleet.kv
    assert (kv.max_loras, kv.max_blocks, kv.max_worker_sets) == (3, 77, 5)


def test_the_relay_keys_are_read_from_a_file_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "meshkit.toml"
    path.write_text(
        '[kv]\nrelay = "tcp://relay:5600"\n\n'
        '[kv_relay]\nbind = "tcp://*:5600"\npublishers = ["tcp://gpu:5557"]\nsend_hwm = 50\n'
        "follow_routers = false\nmax_followed = 3\n"
    )
    config = MeshConfig.from_file(str(path))
    assert (config.kv_relay.follow_routers, config.kv_relay.max_followed) == (False, 3)
    assert MeshConfig.build().kv_relay.follow_routers is True
    with pytest.raises(ConfigError) as info:
        MeshConfig.build(kv_relay={"max_followed": 0})
    assert info.value.key == "kv_relay.max_followed"
    assert config.kv.relay == "tcp://relay:5600"
    assert config.kv_relay.bind == "tcp://*:5600"
    assert config.kv_relay.publishers == ("tcp://gpu:5557",)
    assert config.kv_relay.send_hwm == 50
    assert config.kv.relays == ("tcp://relay:5600",) and config.kv.relay_replays == ()


def test_a_relays_publisher_may_name_its_replay_endpoint() -> None:
    from meshkit.config import publisher_endpoints

    config = MeshConfig.build(
        kv_relay={"publishers": ["tcp://gpu-1:5557,tcp://gpu-1:5558", "tcp://gpu-2:5557"]}
    )
    assert publisher_endpoints(config.kv_relay.publishers, "kv_relay.publishers") == {
        "tcp://gpu-1:5557": "tcp://gpu-1:5558",
        "tcp://gpu-2:5557": None,
    }
    for bad in ("tcp://a:1,tcp://a:2,tcp://a:3", ",tcp://a:2", "tcp://a:1,http://a:2"):
        with pytest.raises(ConfigError) as info:
            MeshConfig.build(kv_relay={"publishers": [bad]})
        assert info.value.key == "kv_relay.publishers"


def test_several_relays_are_a_list_each_with_its_replay_endpoint(tmp_path: Path) -> None:
    path = tmp_path / "meshkit.toml"
    path.write_text(
        '[kv]\nrelay = ["tcp://relay-a:5600", "tcp://relay-b:5600"]\n'
        'relay_replay = ["tcp://relay-a:5601", "tcp://relay-b:5601"]\n'
        "heartbeat_s = 2.5\ntrail_batches = 64\n"
    )
    kv = MeshConfig.from_file(str(path)).kv
    assert kv.relays == ("tcp://relay-a:5600", "tcp://relay-b:5600")
    assert kv.relay_replays == ("tcp://relay-a:5601", "tcp://relay-b:5601")
    assert (kv.heartbeat_s, kv.trail_batches) == (2.5, 64)
    assert MeshConfig.build(kv={"heartbeat_s": 0}).kv.heartbeat_s == 0  # never


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"relay": ["tcp://a:5600", "tcp://b:5600"], "relay_replay": "tcp://a:5601"}, "one"),
        ({"relay": ["tcp://a:5600"], "relay_replay": ["tcp://a:5601", "tcp://b:5601"]}, "one"),
        ({"relay": ["tcp://a:5600", "tcp://*:5600"]}, ""),
        ({"relay": ["tcp://a:5600", 5600]}, ""),
        ({"heartbeat_s": -1}, ">= 0"),
        ({"trail_batches": 0}, "at least 1"),
    ],
)
def test_bad_relay_lists_and_bounds_are_refused(values: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        MeshConfig.build(kv=values)
    key = next(iter(values)) if "relay_replay" not in values else "kv.relay_replay"
    assert info.value.key == (key if key.startswith("kv.") else f"kv.{key}")
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("section", "values", "key"),
    [
        ("kv", {"relay": "tcp://*:5600"}, "kv.relay"),  # one connects to a relay
        ("kv", {"relay": "http://relay:5600"}, "kv.relay"),
        ("kv_relay", {"bind": "relay:5600"}, "kv_relay.bind"),
        ("kv_relay", {"publishers": "tcp://gpu:5557"}, "kv_relay.publishers"),
        ("kv_relay", {"publishers": ["tcp://*:5557"]}, "kv_relay.publishers"),
        ("kv_relay", {"send_hwm": 0}, "kv_relay.send_hwm"),
        ("kv_relay", {"metrics_port": 70000}, "kv_relay.metrics_port"),
    ],
)
def test_bad_relay_keys_name_themselves(section: str, values: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as info:
        MeshConfig.build(**cast("dict[str, Any]", {section: values}))
    assert info.value.key == key
