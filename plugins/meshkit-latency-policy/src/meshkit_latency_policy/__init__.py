"""
Latency-aware placement (an example plugin)
===========================================

:class:`LatencyAware` prefers the candidate whose worker answered with the lowest
recent time to first token (TTFT). It learns from
:meth:`~meshkit.core.policies.Policy.on_complete`, which the ``Mesh`` calls with a
:class:`~meshkit.core.policies.Completion` carrying ``ttft`` in seconds, and keeps
one exponentially weighted moving average per worker origin (DP ranks of one
server share its queue and its speed).

- Candidates without a measurement, or whose last one is older than ``stale_s``,
  are tried first: a worker that was slow once is not starved forever.
- Candidates within ``tolerance`` of the best TTFT are equivalent; the least
  loaded of them wins, so a fast worker is not buried under all the traffic.

Like every policy it is pure: time arrives as ``ctx.now`` / ``now``.

It is registered under the ``meshkit.policies`` entry-point group as ``latency``::

    [project.entry-points."meshkit.policies"]
    latency = "meshkit_latency_policy:LatencyAware"
"""

from __future__ import annotations

from meshkit.policies import (
    BasePolicy,
    Candidate,
    Completion,
    ConfigError,
    PlacementContext,
    RequestView,
    Worker,
)

__all__ = ["LatencyAware"]


class LatencyAware(BasePolicy):
    """Lowest recent TTFT, exploring unmeasured workers first, load as the tiebreak.

    :param alpha: weight of the newest sample in the EWMA (0 < alpha <= 1).
    :param tolerance: TTFTs within this fraction of the best are considered equal.
    :param stale_s: re-explore a worker whose newest sample is older than this
        (``None``: never).
    """

    name = "latency"

    def __init__(
        self, alpha: float = 0.3, tolerance: float = 0.1, stale_s: float | None = 60.0
    ) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ConfigError("policies.latency.alpha", "must be in (0, 1]")
        if tolerance < 0:
            raise ConfigError("policies.latency.tolerance", "must be >= 0")
        self.alpha = alpha
        self.tolerance = tolerance
        self.stale_s = stale_s
        #: origin -> (EWMA of TTFT in seconds, ``now`` of the newest sample)
        self._ttft: dict[str, tuple[float, float]] = {}

    def ttft(self, origin: str) -> float | None:
        """The current TTFT estimate of ``origin`` (``None`` before any sample)."""
        entry = self._ttft.get(origin)
        return entry[0] if entry else None

    def _measured(self, cand: Candidate, now: float) -> float | None:
        entry = self._ttft.get(cand.origin)
        if entry is None:
            return None
        if self.stale_s is not None and now - entry[1] > self.stale_s:
            return None
        return entry[0]

    def select(self, ctx: PlacementContext) -> Candidate:
        cands = ctx.candidates
        scores = [self._measured(c, ctx.now) for c in cands]
        untried = [c for c, s in zip(cands, scores, strict=True) if s is None]
        if untried:
            return min(untried, key=ctx.load_of)
        known = [s for s in scores if s is not None]
        limit = min(known) * (1.0 + self.tolerance)
        near = [
            (ctx.load_of(c), s, i)
            for i, (c, s) in enumerate(zip(cands, scores, strict=True))
            if s is not None and s <= limit
        ]
        return cands[min(near)[2]]

    def on_complete(self, cand: Candidate, view: RequestView, done: Completion, now: float) -> None:
        if not done.ok or done.ttft is None or done.ttft < 0:
            return
        prev = self._ttft.get(cand.origin)
        value = done.ttft if prev is None else prev[0] + self.alpha * (done.ttft - prev[0])
        self._ttft[cand.origin] = (value, now)

    def on_removed(self, worker: Worker) -> None:
        self._ttft.pop(worker.origin, None)
