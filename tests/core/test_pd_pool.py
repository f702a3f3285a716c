"""A PD leg that found no free connection (``Failure.POOL``): 503, no verdict."""

from __future__ import annotations

import random

import pytest
from test_forward import FakeLease, FakePlacer, view_of

from meshkit.core.forward import AttemptResult, Failure, Pair, PairResult
from meshkit.core.pd import pd_flow
from meshkit.core.requests import RequestView
from meshkit.core.workers import Candidate, Worker
from meshkit.errors import Overloaded

POOL = AttemptResult.failed(Failure.POOL)
NEUTRAL = (None, None)


class PdLease(FakeLease):
    started = 0.0


class PdFake(FakePlacer):
    def lease(self, cand: Candidate, view: RequestView, *, admission: bool = True) -> PdLease:
        self.fleet.acquire(cand, view.prompt_weight)
        lease = PdLease(self.fleet, cand, view.prompt_weight)
        self.leases.append(lease)
        return lease

    def place_pair(self, view: RequestView) -> tuple[Candidate, Candidate]:
        p, d = self.fleet.candidates
        return p, d

    def pd_event(self, kind: str) -> None:
        pass


def _placer() -> PdFake:
    return PdFake(
        [
            Worker("http://p:1", labels={"mesh.role": "prefill", "mesh.bootstrap_port": "9000"}),
            Worker("http://d:1", labels={"mesh.role": "decode"}),
        ]
    )


def _leases(placer: PdFake) -> list[FakeLease]:
    return placer.leases


@pytest.mark.parametrize("which", ["prefill", "decode"])
def test_sglang_pair_pool_timeout_is_503_and_blames_neither(which: str) -> None:
    placer = _placer()
    flow = pd_flow(
        placer,
        view_of("/generate", {"text": "hi"}),
        [],
        method="POST",
        protocol="sglang",
        rng=random.Random(0),
    )
    step = next(flow)
    assert isinstance(step, Pair)
    ok = AttemptResult.response(200)
    result = (
        PairResult(failure=Failure.POOL, prefill=ok)
        if which == "decode"
        else PairResult(status=200, prefill=POOL)
    )
    with pytest.raises(Overloaded):
        flow.send(result)
    assert [le.releases for le in _leases(placer)] == [[NEUTRAL], [NEUTRAL]]


def test_vllm_prefill_pool_timeout_is_503_and_blames_no_one() -> None:
    placer = _placer()
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    flow = pd_flow(
        placer,
        view_of("/v1/chat/completions", chat),
        [],
        method="POST",
        protocol="vllm",
        rng=random.Random(0),
    )
    next(flow)
    with pytest.raises(Overloaded):
        flow.send(POOL)
    assert [le.releases for le in _leases(placer)] == [[NEUTRAL]]
