"""
Engine load, from the engines' own Prometheus metrics
=====================================================

Every router polls each engine's ``/metrics`` on the probe interval, so each one
sees the load *all* routers put on a worker, not only its own share. The names
read, as the engines define them:

* vLLM (``vllm/v1/metrics/loggers.py``): ``vllm:num_requests_running``,
  ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (older releases:
  ``vllm:gpu_cache_usage_perc``);
* SGLang (``python/sglang/srt/metrics/collector.py``): ``sglang:num_running_reqs``,
  ``sglang:num_queue_reqs``, ``sglang:token_usage``;
* llama.cpp's server (``tools/server/server-task.cpp``,
  ``server_task_result_metrics::to_metrics``; ``--metrics``):
  ``llamacpp:requests_processing`` (slots processing a request) and
  ``llamacpp:requests_deferred`` (requests queued for a free slot). Current
  releases publish no KV usage gauge; older ones
  (``examples/server/server.cpp``) had ``llamacpp:kv_cache_usage_ratio``
  (used cells / ``n_ctx``), read when present.

Samples are summed over their label sets (a DP engine reports one per rank). A
text with none of them is no answer (llama.cpp without ``--metrics``, a proxy):
the worker then counts only this router's requests.

:func:`others` turns a report into the load *other* routers put there: what the
engine holds minus what this router had in flight when it read the report. The
router keeps a running mean of it over reports (the newest weighs
``workers.OTHERS_WEIGHT``, a half) and adds that to its own live count, so its own
new requests count at once and the others' at the next poll. A single report is
a snapshot: where requests last less than the probe interval it is stale before
it is used, and four routers at 32 clients that added each snapshot as it came
spilled on its noise (``benchmarks/MULTI_ROUTER_LONG.md``).

Pure: the lifecycle thread fetches the text.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineLoad", "others", "parse_metrics"]

_RUNNING = (
    b"vllm:num_requests_running",
    b"sglang:num_running_reqs",
    b"llamacpp:requests_processing",
)
_WAITING = (
    b"vllm:num_requests_waiting",
    b"sglang:num_queue_reqs",
    b"llamacpp:requests_deferred",
)
_KV_USAGE = (
    b"vllm:kv_cache_usage_perc",
    b"vllm:gpu_cache_usage_perc",
    b"sglang:token_usage",
    b"llamacpp:kv_cache_usage_ratio",
)
_WANTED = {n: i for i, names in enumerate((_RUNNING, _WAITING, _KV_USAGE)) for n in names}


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One engine's report: requests running and waiting, KV cache in use (0-1)."""

    running: int
    waiting: int
    kv_usage: float | None = None

    @property
    def requests(self) -> int:
        return self.running + self.waiting


def parse_metrics(text: bytes) -> EngineLoad | None:
    """The engine load in a Prometheus text exposition, or None when it has none."""
    sums = [0.0, 0.0, 0.0]
    seen = [False, False, False]
    for line in text.splitlines():
        if not line or line[0] == 35:  # "#": HELP, TYPE
            continue
        end = line.find(b"{")
        if end < 0:
            end = line.find(b" ")
        which = _WANTED.get(line[:end] if end > 0 else line)
        if which is None:
            continue
        close = line.rfind(b"}")
        fields = line[close + 1 :].split() if close > 0 else line[end:].split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if value != value or value < 0:  # NaN or nonsense: not a load
            continue
        sums[which] += value
        seen[which] = True
    if not (seen[0] or seen[1]):
        return None
    kv = min(1.0, sums[2]) if seen[2] else None
    return EngineLoad(int(sums[0]), int(sums[1]), kv)


def others(report: EngineLoad, mine_at_report: int) -> int:
    """The requests other routers hold on the engine (never below zero)."""
    return max(0, report.requests - mine_at_report)
