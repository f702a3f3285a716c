"""
One ``/metrics`` for many processes
===================================

With ``meshkit serve --processes N`` a scrape reaches one child; that child answers
for the whole gateway: its own text merged with every sibling's (asked on the
siblings' private sockets, :mod:`meshkit.server.peers`), parsed with
``prometheus_client``'s parser and written again in the classic text format.

================================  ================================================
counters, histograms              summed over the processes per identical label
                                  set (``_total``, ``_count``, ``_sum``,
                                  ``_bucket``); ``_created`` is dropped (each
                                  process has its own, and no sum of them means
                                  anything)
gauges (and untyped, summaries)   one sample per process, with the label
                                  ``process="<index>"``: the fleet-wide value is
                                  ``sum without (process) (...)`` in PromQL
``mesh_gateway_processes``        the configured number of processes
``mesh_gateway_processes_up``     this process and the siblings whose text was
                                  merged into this scrape
``mesh_gateway_kv_relay_up``      with a KV-event relay child: 1 when its text
                                  (``mesh_kv_relay_*``, gauges labelled
                                  ``process="kv-relay"``) was merged, else 0
``mesh_gateway_connections``      the client connections each process holds
                                  (``process`` label; absent while it is not
                                  accepting), from the counts the processes share
                                  (:mod:`meshkit.server.accept`)
``mesh_gateway_connections_``     connections a process accepted and handed to a
``handed_total``                  sibling holding fewer
================================  ================================================

A sibling that does not answer (or answers with something that does not parse) is
left out of the scrape, which still answers: its counters are missing from the
sums until it is back, and ``mesh_gateway_processes_up`` says so. The output is
the same whichever child is scraped (processes are merged in index order).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from meshkit.server.supervisor import RELAY_INDEX

__all__ = ["PROCESS_LABEL", "RELAY_LABEL", "merge_metrics"]

#: The label a gauge's samples carry, one per process.
PROCESS_LABEL = "process"
#: ...its value on the KV-event relay child's gauges
RELAY_LABEL = "kv-relay"
_SUMMED = frozenset({"counter", "histogram"})
_CREATED = "_created"


class _Families(Collector):
    """Already-built families, for ``generate_latest``."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


def _parse(text: str) -> list[Metric] | None:
    try:
        return list(text_string_to_metric_families(text))
    except (ValueError, IndexError, TypeError):
        return None


def merge_metrics(
    texts: Sequence[tuple[int, bytes]],
    count: int,
    connections: Sequence[int] | None = None,
    handed: int | None = None,
    *,
    relay: bool = False,
) -> bytes:
    """The classic Prometheus text of the processes' ``(index, /metrics body)``
    merged as the module docstring says; ``count`` is ``--processes``;
    ``connections`` what each process holds (negative: not accepting) and
    ``handed`` the connections handed between them, when the server shares them;
    ``relay``: the gateway runs a KV-event relay child, whose text is the one at
    :data:`~meshkit.server.supervisor.RELAY_INDEX` when it answered."""
    parsed: list[tuple[int, list[Metric]]] = []
    for index, body in sorted(texts, key=lambda t: t[0]):
        families = _parse(body.decode("utf-8", "replace"))
        if families is not None:
            parsed.append((index, families))
    merged: dict[str, Metric] = {}
    # Per family: sample (name, labels) -> its position in merged[name].samples.
    slots: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], int]] = {}
    for index, families in parsed:
        summed = {f.name for f in families if f.type in _SUMMED}
        for fam in families:
            # A counter's or histogram's _created is written as a gauge family of its own.
            if fam.name.endswith(_CREATED) and fam.name[: -len(_CREATED)] in summed:
                continue
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                slots[fam.name] = {}
            elif out.type != fam.type:
                continue  # another version's family of the same name: this process's stays
            positions = slots[fam.name]
            add = fam.type in _SUMMED
            for s in fam.samples:
                if add and s.name == fam.name + _CREATED:
                    continue
                labels = dict(s.labels)
                if not add:
                    labels[PROCESS_LABEL] = RELAY_LABEL if index == RELAY_INDEX else str(index)
                key = (s.name, tuple(sorted(labels.items())))
                at = positions.get(key)
                if at is None:
                    positions[key] = len(out.samples)
                    out.add_sample(s.name, labels, s.value)
                else:
                    prev = out.samples[at]
                    out.samples[at] = prev._replace(value=prev.value + s.value)
    families_out = list(merged.values())
    families_out.append(
        GaugeMetricFamily(
            "mesh_gateway_processes", "Processes the gateway runs (--processes)", value=count
        )
    )
    families_out.append(
        GaugeMetricFamily(
            "mesh_gateway_processes_up",
            "Processes whose metrics this scrape merged (this one included)",
            value=sum(1 for index, _ in parsed if index != RELAY_INDEX),
        )
    )
    if relay:
        families_out.append(
            GaugeMetricFamily(
                "mesh_gateway_kv_relay_up",
                "Whether this scrape merged the KV-event relay child's metrics",
                value=any(index == RELAY_INDEX for index, _ in parsed),
            )
        )
    if connections is not None:
        held = GaugeMetricFamily(
            "mesh_gateway_connections",
            "Client connections each process holds",
            labels=[PROCESS_LABEL],
        )
        for index, n in enumerate(connections):
            if n >= 0:
                held.add_metric([str(index)], n)
        families_out.append(held)
    if handed is not None:
        families_out.append(
            CounterMetricFamily(
                "mesh_gateway_connections_handed",
                "Connections a process accepted and handed to a sibling holding fewer",
                value=handed,
            )
        )
    return generate_latest(_Families(families_out))
