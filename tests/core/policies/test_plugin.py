"""Plugins: the meshkit.policies entry-point group and the example latency policy."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from meshkit.core.policies import Completion, Policy, available, create_policy
from meshkit.core.policies.registry import ENTRY_POINT_GROUP
from meshkit.errors import ConfigError

PLUGIN_SRC = Path(__file__).resolve().parents[3] / "plugins" / "meshkit-latency-policy" / "src"
INSTALLED = any(ep.name == "latency" for ep in entry_points(group=ENTRY_POINT_GROUP))
needs_plugin = pytest.mark.skipif(
    not INSTALLED, reason="pip install -e plugins/meshkit-latency-policy"
)


@pytest.fixture
def latency_cls(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The plugin's class, imported from the checkout when it is not installed."""
    if not INSTALLED:
        monkeypatch.syspath_prepend(str(PLUGIN_SRC))
    from meshkit_latency_policy import LatencyAware

    return LatencyAware


@needs_plugin
def test_create_policy_resolves_the_entry_point(kit: SimpleNamespace) -> None:
    from meshkit_latency_policy import LatencyAware

    assert "latency" in available()
    p = create_policy("latency", {"alpha": 0.5})
    assert isinstance(p, LatencyAware)
    assert isinstance(p, Policy)
    assert p.alpha == 0.5
    with pytest.raises(ConfigError, match="bad options"):
        create_policy("latency", {"nope": 1})


@needs_plugin
def test_the_plugin_learns_from_on_complete(kit: SimpleNamespace) -> None:
    cs = kit.cands(3)
    p = create_policy("latency")
    v = kit.view("hi")
    for c, ttft in zip(cs, (0.40, 0.05, 0.30), strict=True):
        p.on_complete(c, v, Completion(status=200, ok=True, ttft=ttft), 1.0)
    assert p.select(kit.ctx(cs, v, now=2.0)) == cs[1]
    # The fast worker gets slow: the EWMA follows and the choice moves.
    for _ in range(10):
        p.on_complete(cs[1], v, Completion(status=200, ok=True, ttft=2.0), 3.0)
    assert p.select(kit.ctx(cs, v, now=4.0)) == cs[2]


def test_unknown_policy_names_the_entry_point_group() -> None:
    with pytest.raises(ConfigError, match=ENTRY_POINT_GROUP) as info:
        create_policy("no_such_policy_xyz")
    assert "no_such_policy_xyz" in str(info.value)
    assert ENTRY_POINT_GROUP == "meshkit.policies"


def test_entry_points_are_read_lazily() -> None:
    code = textwrap.dedent(
        """
        import importlib.metadata as md
        calls = []
        real = md.entry_points
        def counting(*args, **kwargs):
            calls.append(kwargs.get("group"))
            return real(*args, **kwargs)
        md.entry_points = counting
        from meshkit.core.policies import create_policy
        print(len(calls))
        create_policy("round_robin")
        create_policy("prefix_hash")
        print(len(calls))
        try:
            create_policy("latency")
        except Exception:
            pass
        print(len(calls) > 0)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        env={**os.environ},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", "0", "True"]


def test_untried_workers_are_explored_first(latency_cls: Any, kit: SimpleNamespace) -> None:
    cs = kit.cands(3)
    p = latency_cls()
    v = kit.view()
    p.on_complete(cs[0], v, Completion(status=200, ok=True, ttft=0.01), 0.0)
    load = {cs[1].key: 2, cs[2].key: 1}
    assert p.select(kit.ctx(cs, v, load=load)) == cs[2]
    p.on_complete(cs[2], v, Completion(status=200, ok=True, ttft=0.02), 0.0)
    assert p.select(kit.ctx(cs, v, load=load)) == cs[1]


def test_near_ties_go_to_the_less_loaded(latency_cls: Any, kit: SimpleNamespace) -> None:
    cs = kit.cands(3)
    p = latency_cls(tolerance=0.1)
    v = kit.view()
    for c, ttft in zip(cs, (0.100, 0.105, 0.5), strict=True):
        p.on_complete(c, v, Completion(status=200, ok=True, ttft=ttft), 0.0)
    assert p.select(kit.ctx(cs, v)) == cs[0]
    load = {cs[0].key: 4, cs[1].key: 1, cs[2].key: 0}
    assert p.select(kit.ctx(cs, v, load=load)) == cs[1]


def test_failures_stale_samples_and_removal(latency_cls: Any, kit: SimpleNamespace) -> None:
    cs = kit.cands(2)
    p = latency_cls(stale_s=30.0)
    v = kit.view()
    p.on_complete(cs[0], v, Completion(status=500, ok=False), 0.0)
    p.on_complete(cs[0], v, Completion(status=200, ok=True, ttft=None), 0.0)
    assert p.ttft(cs[0].origin) is None
    p.on_complete(cs[0], v, Completion(status=200, ok=True, ttft=0.5), 0.0)
    p.on_complete(cs[1], v, Completion(status=200, ok=True, ttft=0.1), 0.0)
    assert p.select(kit.ctx(cs, v, now=10.0)) == cs[1]
    # Both samples are stale after 30 s: explore again, least loaded first.
    assert p.select(kit.ctx(cs, v, load={cs[1].key: 1}, now=40.0)) == cs[0]
    p.on_removed(cs[1].worker)
    assert p.ttft(cs[1].origin) is None
    with pytest.raises(ConfigError, match="alpha"):
        latency_cls(alpha=0)
    with pytest.raises(ConfigError, match="tolerance"):
        latency_cls(tolerance=-1)
