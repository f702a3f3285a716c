"""Which worker serves which model: a label's comma list, or what the worker lists."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from harness import wait_until
from lifecycle.conftest import FAST
from meshkit import Mesh, Worker


def chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


def worker_of(mode: Any, model: str) -> tuple[int, str | None]:
    r = mode.request("POST", "/v1/chat/completions", json=chat(model))
    return r.status, r.headers.get("x-mock-worker")


def test_a_label_names_several_models(mock_factory: Any, mesh_factory: Any, run_mode: Any) -> None:
    ab, c = mock_factory(name="ab"), mock_factory(name="c")
    mesh = mesh_factory(
        workers=[
            Worker(ab.url, labels={"mesh.model": "a, b"}),
            Worker(c.url, labels={"mesh.model": "c"}),
        ],
        lifecycle={"probe": False},
    )
    mode = run_mode(mesh)
    for _ in range(3):
        assert worker_of(mode, "a") == (200, "ab")
        assert worker_of(mode, "b") == (200, "ab")
        assert worker_of(mode, "c") == (200, "c")
    assert worker_of(mode, "z")[0] == 501


def models_learned(mesh: Mesh) -> bool:
    return all(mesh.fleet.models_of(w) for w in mesh.workers)


def test_unlabelled_workers_learn_their_models_from_their_list(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    alpha = mock_factory(name="alpha", model="alpha")
    beta = mock_factory(name="beta", model="beta")
    mesh = mesh_factory(workers=[alpha.url, beta.url], lifecycle=FAST)
    mode = run_mode(mesh)
    mesh.start_lifecycle()
    assert wait_until(lambda: models_learned(mesh))
    described = {d["url"]: d["models"] for d in mesh.router.describe()}
    assert described == {alpha.url: ["alpha"], beta.url: ["beta"]}
    for _ in range(4):
        assert worker_of(mode, "beta") == (200, "beta")
        assert worker_of(mode, "alpha") == (200, "alpha")
    # Listed nowhere: the engines decide (a labelled fleet would refuse with 501).
    assert worker_of(mode, "gamma") in ((200, "alpha"), (200, "beta"))
    listed = mode.request("GET", "/v1/models")
    assert {m["id"] for m in listed.json()["data"]} == {"alpha", "beta"}


@pytest.mark.parametrize("mode_name", ["asgi"])
def test_a_label_wins_over_the_list(mock_factory: Any, mesh_factory: Any, run_mode: Any) -> None:
    mock = mock_factory(name="m", model="listed")
    mesh = mesh_factory(
        workers=[Worker(mock.url, labels={"mesh.model": "labelled"})], lifecycle=FAST
    )
    mesh.start_lifecycle()
    assert wait_until(lambda: mesh.health()["verified_workers"] == 1)
    assert mesh.fleet.models_of(mesh.workers[0]) == frozenset({"labelled"})
    assert worker_of(run_mode(mesh), "labelled") == (200, "m")


def test_the_list_is_read_once_per_interval_and_never_at_zero(
    mock_factory: Any, mesh_factory: Any
) -> None:
    """``lifecycle.models_interval_s`` bounds how often probes read ``/v1/models``."""
    every = mock_factory(name="every", model="listed")
    never = mock_factory(name="never", model="listed")
    slow = mesh_factory(workers=[every.url], lifecycle={**FAST, "models_interval_s": 3600})
    off = mesh_factory(workers=[never.url], lifecycle={**FAST, "models_interval_s": 0})
    for mesh in (slow, off):
        mesh.start_lifecycle()
    probes: Callable[[Any], int] = lambda mock: mock.worker.stats.requests_total.get("/health", 0)  # noqa: E731
    # many probe rounds later ...
    assert wait_until(lambda: probes(every) >= 5 and probes(never) >= 5)
    assert every.worker.stats.requests_total.get("/v1/models", 0) == 1
    assert never.worker.stats.requests_total.get("/v1/models", 0) == 0
    assert slow.fleet.models_of(slow.workers[0]) == frozenset({"listed"})
    assert off.fleet.models_of(off.workers[0]) is None


ADAPTERS = tuple(f"tenant-{i:03d}-lora" for i in range(200))


@pytest.mark.parametrize("mode_name", ["asgi"])
def test_a_long_adapter_list_is_learned_whole(
    mock_factory: Any, mesh_factory: Any, run_mode: Any
) -> None:
    """200 LoRA adapters in vLLM's card shape are ~85 KiB: the list is read up to
    ``bounds.max_captured_body_bytes``, as the model-list fan-out reads it."""
    base = mock_factory(name="lora", model="base", lora_adapters=ADAPTERS)
    other = mock_factory(name="other", model="other")
    mesh = mesh_factory(workers=[base.url, other.url], lifecycle=FAST)
    mode = run_mode(mesh)
    listed = mode.request("GET", "/v1/models")
    assert len(listed.body) > 80 * 1024  # what a worker lists, merged
    mesh.start_lifecycle()
    assert wait_until(lambda: models_learned(mesh))
    assert mesh.fleet.models_of(mesh.workers[0]) == frozenset({"base", *ADAPTERS})
    for name in (ADAPTERS[0], ADAPTERS[-1]):
        assert worker_of(mode, name) == (200, "lora")


@pytest.mark.parametrize(
    ("lifecycle", "bounds", "over"),
    [
        ({"max_models_per_worker": 100}, {}, "lifecycle.max_models_per_worker (100)"),
        ({}, {"max_captured_body_bytes": 60_000}, "bounds.max_captured_body_bytes (60000 bytes)"),
    ],
    ids=["more-models", "more-bytes"],
)
@pytest.mark.parametrize("mode_name", ["asgi"])
def test_a_list_over_a_bound_leaves_the_models_unknown(
    mock_factory: Any,
    mesh_factory: Any,
    run_mode: Any,
    caplog: Any,
    lifecycle: dict[str, Any],
    bounds: dict[str, Any],
    over: str,
) -> None:
    """Part of a list is not the list: the adapters it left out would be refused on
    that worker. Unknown, every model may go there (the engine decides), and the
    log says which bound it passed."""
    big = mock_factory(name="big", model="base", lora_adapters=ADAPTERS)
    small = mock_factory(name="small", model="other")
    mesh = mesh_factory(
        workers=[big.url, small.url], lifecycle={**FAST, **lifecycle}, bounds=bounds
    )
    mode = run_mode(mesh)
    caplog.set_level("WARNING", logger="meshkit.lifecycle")
    mesh.start_lifecycle()
    assert wait_until(lambda: mesh.fleet.models_of(mesh.workers[1]) == frozenset({"other"}))
    assert wait_until(lambda: big.worker.stats.requests_total.get("/v1/models", 0) >= 1)
    assert wait_until(lambda: any(over in r.getMessage() for r in caplog.records))
    assert mesh.fleet.models_of(mesh.workers[0]) is None
    assert worker_of(mode, ADAPTERS[-1]) == (200, "big")  # "other" does not list it
    assert worker_of(mode, "other") in ((200, "big"), (200, "small"))
