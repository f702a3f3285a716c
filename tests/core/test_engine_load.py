"""Engine load from Prometheus text (:mod:`meshkit.core.engine_load`), pinned on the
lines vLLM, SGLang and llama.cpp print, and what other routers hold."""

from __future__ import annotations

from pathlib import Path

from meshkit.core.engine_load import EngineLoad, others, parse_metrics
from meshkit.core.workers import Fleet, Worker

# As vLLM's /metrics prints them (prometheus_client, one sample per engine/model).
VLLM = b"""# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_running{engine="1",model_name="tiny"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 4.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:num_requests_running_total_not_this 99
vllm:prompt_tokens_total{engine="0",model_name="tiny"} 1234.0
"""
# Captured byte for byte from a real llama.cpp server: xllamacpp 2026.10.11549
# (llama.cpp's tools/server), SmolLM2-135M-Instruct Q4_1, n_parallel 1, with one
# request generating and two more queued behind it (GET /metrics mid-flight).
LLAMACPP = (Path(__file__).parent / "fixtures" / "llamacpp" / "metrics.txt").read_bytes()
SGLANG = b"""# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",tp_rank="0"} 7
sglang:num_queue_reqs{model_name="m",tp_rank="0"} 1
sglang:token_usage{model_name="m",tp_rank="0"} 0.5
"""


def test_vllm_lines_are_summed_over_engines() -> None:
    assert parse_metrics(VLLM) == EngineLoad(5, 4, 0.25)


def test_sglang_lines() -> None:
    assert parse_metrics(SGLANG) == EngineLoad(7, 1, 0.5)


def test_llamacpp_capture() -> None:
    # llamacpp:requests_processing 1 (the slot generating), llamacpp:requests_deferred 2
    # (queued for it); this build publishes no KV usage gauge.
    assert b"llamacpp:requests_processing 1\n" in LLAMACPP
    assert b"llamacpp:requests_deferred 2\n" in LLAMACPP
    assert parse_metrics(LLAMACPP) == EngineLoad(1, 2, None)
    # An idle server says 0 and 0: a report, not no answer.
    idle = LLAMACPP.replace(b"processing 1\n", b"processing 0\n").replace(
        b"deferred 2\n", b"deferred 0\n"
    )
    assert parse_metrics(idle) == EngineLoad(0, 0, None)


def test_llamacpp_older_kv_ratio() -> None:
    # Older llama.cpp servers (examples/server/server.cpp) also printed a KV ratio.
    older = b"""# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.375
llamacpp:kv_cache_tokens 1536
llamacpp:requests_processing 2
llamacpp:requests_deferred 0
"""
    assert parse_metrics(older) == EngineLoad(2, 0, 0.375)


def test_no_load_gauges_is_no_report() -> None:
    assert parse_metrics(b"# llama.cpp without --metrics\nfoo 1\n") is None
    assert parse_metrics(b"") is None
    # garbage and NaN are skipped, not a crash
    assert (
        parse_metrics(b"vllm:num_requests_running{ nonsense\nvllm:num_requests_waiting NaN\n")
        is None
    )
    assert parse_metrics(b"vllm:num_requests_waiting 2\n") == EngineLoad(0, 2, None)


def test_others_are_the_engines_load_minus_ours() -> None:
    assert others(EngineLoad(5, 4), 3) == 6
    assert others(EngineLoad(1, 0), 3) == 0  # our requests not yet there: never negative


def test_placement_weighs_other_routers_requests() -> None:
    a = Worker("http://a:1")
    dp = Worker("http://b:1", labels={"mesh.dp_size": "2"})
    fleet = Fleet([a, dp])
    (ca,) = fleet.candidates_of(a)
    fleet.load[ca.key] = 2
    fleet.worker_load[a.id] = 2
    assert fleet.placement_load() is fleet.load  # no report: only ours
    fleet.report_load(a.id, EngineLoad(running=6, waiting=1))
    assert fleet.placement_load()[ca.key] == 2 + 5
    fleet.report_load(dp.id, EngineLoad(running=3, waiting=0))
    b0, b1 = fleet.candidates_of(dp)
    assert (fleet.others[b0.key], fleet.others[b1.key]) == (2, 1)  # spread over the ranks
    fleet.report_load(a.id, None)  # it stopped answering: ours only again
    assert fleet.placement_load()[ca.key] == 2
    fleet.remove(dp.id)
    assert not fleet.others and not fleet.engine


def test_other_routers_load_is_a_mean_over_reports_not_the_last_snapshot() -> None:
    a = Worker("http://a:1")
    fleet = Fleet([a])
    (ca,) = fleet.candidates_of(a)
    # Snapshots of a load that flickers (short requests, a slow poll): 0, 8, 0, 8...
    seen = []
    for running in (0, 8, 0, 8, 0, 8, 0, 8):
        fleet.report_load(a.id, EngineLoad(running=running, waiting=0))
        seen.append(fleet.placement_load().get(ca.key, 0))
    assert seen[0] == 0  # the first report is taken as it is
    # A snapshot would swing 0 <-> 8; the mean settles between them.
    assert all(2 <= x <= 6 for x in seen[2:]), seen
    # A lasting change is followed within a few reports.
    for _ in range(4):
        fleet.report_load(a.id, EngineLoad(running=20, waiting=0))
    assert fleet.placement_load()[ca.key] >= 19
    # No report (the engine stopped answering) forgets the mean: the next starts anew.
    fleet.report_load(a.id, None)
    fleet.report_load(a.id, EngineLoad(running=3, waiting=0))
    assert fleet.placement_load()[ca.key] == 3
