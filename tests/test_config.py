"""Table tests for :mod:`meshkit.config`: kwargs, TOML files, the environment, secrecy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from meshkit.config import (
    MeshConfig,
    PrepareConfig,
    RoutingConfig,
    UpstreamConfig,
    parse_worker_arg,
)
from meshkit.core.endpoints import Api
from meshkit.core.workers import Fleet, Worker
from meshkit.errors import ConfigError

P = pytest.param
SECRET = "sk-very-SECRET-worker-key"
ADMIN = "admin-SECRET-key"


def test_defaults() -> None:
    c = MeshConfig.build()
    assert c == MeshConfig()
    assert c.policy == "round_robin"
    assert c.workers == ()
    assert c.upstream.max_attempts == 3
    assert c.prepare.max_tokenize_bytes == 4 * 1024 * 1024


def test_build_from_kwargs_and_section_dicts() -> None:
    c = MeshConfig.build(
        workers=[
            "http://a:1",
            {"url": "http://b:1", "api_key": SECRET, "labels": {"mesh.apis": "chat"}},
            Worker("http://c:1"),
        ],
        policy="prefix_hash",
        policies={"prefix_hash": {"prefix_token_count": 256}},
        tokenizer="tok.json",
        tokenizers={"m": "m.json"},
        prepare={"workers": 2, "queue_capacity": 64},
        upstream={"connect_timeout_s": 1, "max_attempts": 5},
        routing={"session_header": None, "seed": 7},
        lifecycle={"probe": False},
        metrics={"enabled": False},
    )
    assert [w.url for w in c.workers] == ["http://a:1", "http://b:1", "http://c:1"]
    assert c.workers[1].api_key == SECRET
    assert c.workers[1].apis == frozenset({Api.CHAT})
    assert c.policy == "prefix_hash"
    assert c.policies == {"prefix_hash": {"prefix_token_count": 256}}
    assert c.prepare == PrepareConfig(workers=2, queue_capacity=64)
    assert c.upstream.connect_timeout_s == 1.0
    assert isinstance(c.upstream.connect_timeout_s, float)
    assert c.upstream.max_attempts == 5
    assert c.routing == RoutingConfig(session_header=None, seed=7)
    assert c.lifecycle.probe is False
    assert c.metrics.enabled is False


def test_build_accepts_section_objects() -> None:
    up = UpstreamConfig(max_attempts=1)
    c = MeshConfig.build(upstream=up)
    assert c.upstream is up


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        P({"polcy": "x"}, "polcy", id="top-level-typo"),
        P({"prepare": {"worker": 2}}, "prepare.worker", id="section-key"),
        P({"upstream": {"retries": 2}}, "upstream.retries", id="upstream-key"),
        P({"workers": [{"url": "http://a:1", "key": "x"}]}, "workers[0].key", id="worker-key"),
        P({"workers": ["http://a:1", {"uri": "x"}]}, "workers[1].uri", id="second-worker"),
    ],
)
def test_unknown_key_names_the_key(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as ei:
        MeshConfig.build(**kwargs)
    assert ei.value.key == key
    assert repr(key) in str(ei.value)
    assert "unknown key" in str(ei.value)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        P({"prepare": {"workers": "two"}}, "prepare.workers", id="int-str"),
        P({"prepare": {"queue_capacity": -1}}, "prepare.queue_capacity", id="int-negative"),
        P({"prepare": {"queue_capacity": 1.5}}, "prepare.queue_capacity", id="int-float"),
        P(
            {"prepare": {"prefix_cache_entries": -1}},
            "prepare.prefix_cache_entries",
            id="cache-negative",
        ),
        P({"prepare": {"queue_capacity": True}}, "prepare.queue_capacity", id="int-bool"),
        P({"upstream": {"connect_timeout_s": "5"}}, "upstream.connect_timeout_s", id="float-str"),
        P({"upstream": {"backoff_max_s": -0.1}}, "upstream.backoff_max_s", id="float-negative"),
        P({"upstream": {"read_timeout_s": False}}, "upstream.read_timeout_s", id="float-bool"),
        P({"metrics": {"enabled": 1}}, "metrics.enabled", id="bool-int"),
        P({"metrics": {"enabled": "yes"}}, "metrics.enabled", id="bool-str"),
        P({"lifecycle": {"health_path": 5}}, "lifecycle.health_path", id="str-int"),
        P({"routing": {"seed": "x"}}, "routing.seed", id="optional-int"),
        P({"routing": {"session_header": 5}}, "routing.session_header", id="optional-str"),
        P({"prepare": 5}, "prepare", id="section-not-table"),
        P({"prepare": [1]}, "prepare", id="section-list"),
        P({"tokenizer": 5}, "tokenizer", id="tokenizer"),
        P({"admin_key": 5}, "admin_key", id="admin-key"),
        P({"policies": "x"}, "policies", id="policies"),
        P({"tokenizers": ["a"]}, "tokenizers", id="tokenizers"),
        P({"workers": [5]}, "workers[0]", id="worker-int"),
        P({"workers": [{"url": 5}]}, "workers[0].url", id="worker-url-int"),
        P({"workers": [{"url": "http://a:1", "labels": "x"}]}, "workers[0].labels", id="labels"),
        P({"workers": [{"url": "ftp://a"}]}, "workers.url", id="worker-bad-url"),
        P(
            {"workers": [{"url": "http://a:1", "labels": {"mesh.apis": "nope"}}]},
            "workers.labels.mesh.apis",
            id="worker-bad-label",
        ),
    ],
)
def test_wrong_types_name_section_and_key(kwargs: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as ei:
        MeshConfig.build(**kwargs)
    assert ei.value.key == key
    assert repr(key) in str(ei.value)


def test_duplicate_worker_found_when_the_fleet_is_built() -> None:
    c = MeshConfig.build(workers=["http://a:1", "http://A:1/"])
    with pytest.raises(ConfigError) as ei:
        Fleet(c.workers)
    assert ei.value.key == "workers.url"


def test_zero_is_allowed_at_the_bound() -> None:
    c = MeshConfig.build(prepare={"queue_capacity": 0}, upstream={"backoff_max_s": 0})
    assert c.prepare.queue_capacity == 0
    assert c.upstream.backoff_max_s == 0.0


# --------------------------------------------------------------------------------------
# TOML files
# --------------------------------------------------------------------------------------

GOOD = """
policy = "prefix_hash"
tokenizer = "models/qwen/tokenizer.json"

[policies.prefix_hash]
prefix_token_count = 256

[prepare]
workers = 2
queue_capacity = 64
max_tokenize_bytes = 4194304

[[workers]]
url = "http://10.0.0.5:8000"
api_key_env = "MESHKIT_TEST_W1_KEY"
labels = { "mesh.apis" = "chat,completions,responses" }

[[workers]]
url = "http://10.0.0.6:8000"
labels = { "mesh.dp_size" = "2", "mesh.model" = "qwen" }
"""


def test_from_file_good(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHKIT_TEST_W1_KEY", SECRET)
    path = tmp_path / "meshkit.toml"
    path.write_text(GOOD, encoding="utf-8")
    c = MeshConfig.from_file(path)
    assert c.policy == "prefix_hash"
    assert c.tokenizer == "models/qwen/tokenizer.json"
    assert c.policies == {"prefix_hash": {"prefix_token_count": 256}}
    assert (c.prepare.workers, c.prepare.queue_capacity) == (2, 64)
    w1, w2 = c.workers
    assert w1.api_key == SECRET
    assert w1.apis == frozenset({Api.CHAT, Api.COMPLETIONS, Api.RESPONSES})
    assert (w2.dp_size, w2.model, w2.api_key) == (2, "qwen", None)
    assert SECRET not in repr(c)
    assert MeshConfig.from_file(str(path)) == c


def test_from_file_bad_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "broken-config.toml"
    path.write_text('policy = "x\n[prepare\n', encoding="utf-8")
    with pytest.raises(ConfigError) as ei:
        MeshConfig.from_file(path)
    assert "broken-config.toml" in str(ei.value)
    assert ei.value.source == str(path)
    assert "line" in str(ei.value)


def test_from_file_unknown_key_names_key_and_file(tmp_path: Path) -> None:
    path = tmp_path / "meshkit.toml"
    path.write_text("[prepare]\nworkerz = 2\n", encoding="utf-8")
    with pytest.raises(ConfigError) as ei:
        MeshConfig.from_file(path)
    assert ei.value.key == "prepare.workerz"
    assert ei.value.source == str(path)
    assert "meshkit.toml" in str(ei.value)


def test_from_file_bad_worker_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "meshkit.toml"
    path.write_text(
        f'[[workers]]\nurl = "http://a:1"\napi_key = "{SECRET}"\n'
        'labels = { "mesh.role" = "boss" }\n',
        encoding="utf-8",
    )
    with pytest.raises(ConfigError) as ei:
        MeshConfig.from_file(path)
    assert ei.value.key == "workers.labels.mesh.role"
    assert ei.value.source == str(path)
    assert SECRET not in str(ei.value)


def test_from_file_missing(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as ei:
        MeshConfig.from_file(tmp_path / "nope.toml")
    assert "nope.toml" in str(ei.value)


def test_api_key_env_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESHKIT_TEST_ABSENT_KEY", raising=False)
    with pytest.raises(ConfigError) as ei:
        MeshConfig.build(workers=[{"url": "http://a:1", "api_key_env": "MESHKIT_TEST_ABSENT_KEY"}])
    assert ei.value.key == "workers.api_key_env"
    assert "MESHKIT_TEST_ABSENT_KEY" in str(ei.value)


def test_api_key_env_overrides_inline_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHKIT_TEST_KEY", SECRET)
    c = MeshConfig.build(
        workers=[{"url": "http://a:1", "api_key": "inline", "api_key_env": "MESHKIT_TEST_KEY"}]
    )
    assert c.workers[0].api_key == SECRET


# --------------------------------------------------------------------------------------
# the environment
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        P("http://a:1", [("http://a:1", {})], id="one"),
        P("http://a:1,http://b:2", [("http://a:1", {}), ("http://b:2", {})], id="two"),
        P(" http://a:1 , http://b:2 ", [("http://a:1", {}), ("http://b:2", {})], id="spaces"),
        P(
            "http://a:1#mesh.apis=chat,completions;mesh.model=m",
            [("http://a:1", {"mesh.apis": "chat,completions", "mesh.model": "m"})],
            id="label-fragment",
        ),
        P(
            "http://a:1#mesh.apis=chat,completions;mesh.model=m,https://b:2#mesh.dp_size=2",
            [
                ("http://a:1", {"mesh.apis": "chat,completions", "mesh.model": "m"}),
                ("https://b:2", {"mesh.dp_size": "2"}),
            ],
            id="two-with-labels",
        ),
    ],
)
def test_from_env_workers(value: str, expected: list[tuple[str, dict[str, str]]]) -> None:
    c = MeshConfig.from_env({"MESHKIT_WORKERS": value})
    assert [(w.url, w.labels) for w in c.workers] == expected


def test_from_env_label_fragment_parses_apis() -> None:
    c = MeshConfig.from_env(
        {"MESHKIT_WORKERS": "http://a:1#mesh.apis=chat,completions;mesh.model=m"}
    )
    (w,) = c.workers
    assert w.apis == frozenset({Api.CHAT, Api.COMPLETIONS})
    assert w.model == "m"


def test_from_env_config_file_plus_workers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHKIT_TEST_W1_KEY", SECRET)
    path = tmp_path / "m.toml"
    path.write_text(GOOD, encoding="utf-8")
    c = MeshConfig.from_env(
        {"MESHKIT_CONFIG": str(path), "MESHKIT_WORKERS": "http://x:1", "MESHKIT_POLICY": "random"}
    )
    assert [w.url for w in c.workers] == [
        "http://10.0.0.5:8000",
        "http://10.0.0.6:8000",
        "http://x:1",
    ]
    assert c.policy == "random"
    assert c.prepare.workers == 2


def test_from_env_empty() -> None:
    assert MeshConfig.from_env({}) == MeshConfig()


def test_from_env_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESHKIT_CONFIG", raising=False)
    monkeypatch.delenv("MESHKIT_POLICY", raising=False)
    monkeypatch.setenv("MESHKIT_WORKERS", "http://env:1")
    assert [w.url for w in MeshConfig.from_env().workers] == ["http://env:1"]


@pytest.mark.parametrize(
    "value", [P("http://a:1#mesh.apis", id="no-equals"), P("http://a:1#x=1;;bad", id="bad-item")]
)
def test_bad_label_fragment(value: str) -> None:
    with pytest.raises(ConfigError) as ei:
        MeshConfig.from_env({"MESHKIT_WORKERS": value})
    assert ei.value.key == "workers.labels"


def test_parse_worker_arg() -> None:
    assert parse_worker_arg(" http://h:1#a=1; b = 2 ") == {
        "url": "http://h:1",
        "labels": {"a": "1", "b": "2"},
    }


def test_from_env_bad_url_is_config_error() -> None:
    with pytest.raises(ConfigError) as ei:
        MeshConfig.from_env({"MESHKIT_WORKERS": "http://a:1,http://:2"})
    assert ei.value.key == "workers.url"


# --------------------------------------------------------------------------------------
# secrecy
# --------------------------------------------------------------------------------------


def test_keys_never_in_repr() -> None:
    c = MeshConfig.build(
        workers=[{"url": "http://a:1", "api_key": SECRET}, Worker("http://b:1", api_key=SECRET)],
        admin_key=ADMIN,
    )
    text = repr(c) + str(c)
    assert SECRET not in text
    assert ADMIN not in text
    assert "api_key=<set>" in text


@pytest.mark.parametrize(
    "worker",
    [
        P({"url": "http://a:1", "api_key": SECRET, "labels": {"mesh.dp_size": "0"}}, id="dp"),
        P({"url": "ftp://a:1", "api_key": SECRET}, id="url"),
        P({"url": "http://a:1", "api_key": SECRET, "bogus": 1}, id="unknown-key"),
        P({"url": "http://a:1", "api_key": SECRET, "labels": {"mesh.apis": "x"}}, id="apis"),
        P({"url": "http://a:1", "api_key": [SECRET]}, id="key-wrong-type"),
    ],
)
def test_keys_never_in_errors(worker: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as ei:
        MeshConfig.build(workers=[worker], admin_key=ADMIN)
    text = str(ei.value) + repr(ei.value) + " ".join(map(str, ei.value.args))
    assert SECRET not in text
    assert ADMIN not in text


@pytest.mark.parametrize(
    ("section", "key"),
    [
        P("upstream", "read_timeout_s", id="read-timeout"),
        P("upstream", "connect_timeout_s", id="connect-timeout"),
        P("lifecycle", "wake_retry_after_s", id="wake-retry-after"),
    ],
)
def test_nan_is_config_error(tmp_path: Path, section: str, key: str) -> None:
    path = tmp_path / "m.toml"
    path.write_text(f"[{section}]\n{key} = nan\n", encoding="utf-8")
    with pytest.raises(ConfigError) as ei:
        MeshConfig.from_file(path)
    assert ei.value.key == f"{section}.{key}"


# --------------------------------------------------------------------------------------
# admission limits: upstream.max_in_flight_per_worker, upstream.max_in_flight
# --------------------------------------------------------------------------------------


def test_in_flight_limits_default_to_the_pool_limits() -> None:
    up = MeshConfig.build().upstream
    assert (up.max_in_flight_per_worker, up.max_in_flight) == (None, None)
    assert up.in_flight_limit_per_worker == up.pool_limit_per_worker == 256
    assert up.in_flight_limit == up.pool_limit == 1000
    up = MeshConfig.build(upstream={"pool_limit": 8, "pool_limit_per_worker": 4}).upstream
    assert (up.in_flight_limit, up.in_flight_limit_per_worker) == (8, 4)


def test_in_flight_limits_are_always_finite() -> None:
    from meshkit.config import DEFAULT_MAX_IN_FLIGHT

    up = MeshConfig.build(upstream={"pool_limit": 0, "pool_limit_per_worker": 0}).upstream
    assert up.in_flight_limit == DEFAULT_MAX_IN_FLIGHT == 4096  # an unbounded pool
    assert up.in_flight_limit_per_worker == 0  # no per-worker limit; the global one holds
    with pytest.raises(ConfigError) as ei:
        MeshConfig.build(upstream={"max_in_flight": 0})
    assert ei.value.key == "upstream.max_in_flight"


@pytest.mark.parametrize("value", [0, -1])
@pytest.mark.parametrize(
    ("key", "default"),
    [("read_buffer_bytes", 1024 * 1024), ("max_cached_urls", 4096), ("max_cached_timeouts", 64)],
)
def test_the_upstream_bounds_are_at_least_one(key: str, default: int, value: int) -> None:
    assert getattr(MeshConfig.build().upstream, key) == default
    assert getattr(MeshConfig.build(upstream={key: 7}).upstream, key) == 7
    with pytest.raises(ConfigError) as ei:
        MeshConfig.build(upstream={key: value})
    assert ei.value.key == f"upstream.{key}"


@pytest.mark.parametrize(
    "key", ["max_models_per_worker", "max_metrics_bytes", "max_probe_bytes", "max_tracked_workers"]
)
def test_the_lifecycle_read_bounds_are_at_least_one(key: str) -> None:
    assert getattr(MeshConfig.build(lifecycle={key: 9}).lifecycle, key) == 9
    with pytest.raises(ConfigError) as ei:
        MeshConfig.build(lifecycle={key: 0})
    assert ei.value.key == f"lifecycle.{key}"


def test_the_extproc_message_limit_follows_the_body_bound_unless_set() -> None:
    x = MeshConfig.build().extproc
    assert x.max_message_bytes is None
    assert x.message_limit(32 << 20) == (64 << 20) + (1 << 20)
    assert x.message_limit(2**31) == 2**31 - 1  # gRPC's options are C ints
    assert MeshConfig.build(extproc={"max_message_bytes": 5}).extproc.message_limit(1 << 30) == 5
    with pytest.raises(ConfigError) as ei:
        MeshConfig.build(extproc={"max_message_bytes": 0})
    assert ei.value.key == "extproc.max_message_bytes"


def test_sync_leg_threads_are_at_least_one() -> None:
    assert MeshConfig.build().pd.sync_leg_threads == 32
    with pytest.raises(ConfigError) as ei:
        MeshConfig.build(pd={"sync_leg_threads": 0})
    assert ei.value.key == "pd.sync_leg_threads"


def test_in_flight_limits_explicit() -> None:
    up = MeshConfig.build(
        upstream={"max_in_flight": 10, "max_in_flight_per_worker": 0, "pool_limit": 2}
    ).upstream
    assert (up.in_flight_limit, up.in_flight_limit_per_worker) == (10, 0)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        P("max_in_flight", -1, id="global-negative"),
        P("max_in_flight_per_worker", -1, id="per-worker-negative"),
        P("max_in_flight", 1.5, id="global-float"),
        P("max_in_flight_per_worker", "4", id="per-worker-str"),
    ],
)
def test_in_flight_limits_wrong_values(key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as ei:
        MeshConfig.build(upstream={key: value})
    assert ei.value.key == f"upstream.{key}"


def test_mesh_fleet_gets_the_limits() -> None:
    from meshkit import Mesh

    mesh = Mesh(
        workers=["http://a:1"],
        upstream={"max_in_flight": 7, "max_in_flight_per_worker": 3},
        lifecycle={"probe": False},
    )
    try:
        assert (mesh.fleet.max_in_flight, mesh.fleet.max_in_flight_per_worker) == (7, 3)
    finally:
        mesh.close()


@pytest.mark.parametrize(
    "key",
    [
        "max_body_bytes",
        "max_header_bytes",
        "max_headers",
        "max_sse_line_bytes",
        "max_json_depth",
        "max_captured_body_bytes",
        "max_admin_body_bytes",
    ],
)
def test_every_bound_is_at_least_one(key: str) -> None:
    assert getattr(MeshConfig.build().bounds, key) >= 1
    assert getattr(MeshConfig.build(bounds={key: 1}).bounds, key) == 1
    with pytest.raises(ConfigError) as ei:
        MeshConfig.build(bounds={key: 0})
    assert ei.value.key == f"bounds.{key}"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("responses_affinity_max", 0),
        ("responses_affinity_ttl_s", 0),
        ("responses_lookup_ttl_s", -1.0),
        ("responses_counted_max", 0),
    ],
)
def test_a_bad_routing_bound_is_named_by_the_key_the_user_wrote(key: str, value: float) -> None:
    # The affinity maps checked these themselves, naming "responses_affinity.max_entries".
    with pytest.raises(ConfigError) as ei:
        MeshConfig.build(routing={key: value})
    assert ei.value.key == f"routing.{key}"
