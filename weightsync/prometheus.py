"""Prometheus export of ``statistics()`` (the ``weightsync[prometheus]`` extra).

``register(end)`` adds a collector for a Publisher or Subscriber (blocking ones too) to a
``prometheus_client`` registry (default: the global one, which vLLM and most serving stacks
already serve). Each scrape reads one :mod:`weightsync.statistics` snapshot: nothing is counted
twice, and nothing here runs between scrapes. Names follow Prometheus' conventions: a
``weightsync_`` prefix, ``_total`` counters, ``_seconds`` and ``_bytes`` units, and the channel
(and member) as labels::

    from prometheus_client import start_http_server
    from weightsync.prometheus import register

    register(pub)                 # in the trainer
    start_http_server(9400)

Only this module imports ``prometheus_client``; ``import weightsync`` never does.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import REGISTRY, CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from weightsync.statistics import PublisherStatistics, Quantiles, SubscriberStatistics

__all__ = ["WeightsyncCollector", "register", "unregister"]


def _summary(name: str, doc: str, labels: dict[str, str], q: Quantiles) -> Metric:
    metric = Metric(name, doc, "summary")
    for quantile, value in (("0.5", q.p50), ("0.9", q.p90), ("0.99", q.p99)):
        metric.add_sample(name, {**labels, "quantile": quantile}, value)
    metric.add_sample(f"{name}_count", labels, q.count)
    metric.add_sample(f"{name}_sum", labels, q.total)
    return metric


def _counter(name: str, doc: str, labels: dict[str, str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def _gauge(name: str, doc: str, labels: dict[str, str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def publisher_metrics(s: PublisherStatistics) -> Iterator[Metric]:
    ch = {"channel": s.channel}
    for field, doc in (("versions_put", "Versions put"), ("versions_delivered", "Versions that reached a member"),
                       ("versions_to_nobody", "Versions sent while the channel had no member"),
                       ("versions_superseded", "Puts replaced by a newer one before they were sent"),
                       ("versions_failed", "Versions that could not be sent"),
                       ("resends", "Versions sent again after a failed attempt"),
                       ("delta_fallbacks", "Versions re-sent in full because a member could not apply their delta"),
                       ("generations", "Generations formed (joins, leaves, evictions)")):
        yield _counter(f"weightsync_{field}", doc, ch, getattr(s, field))
    yield _counter("weightsync_put_bytes", "Payload bytes of the versions sent", ch, s.bytes_put)
    yield _counter("weightsync_delivered_bytes", "Payload bytes times the members each version reached", ch,
                   s.bytes_delivered)
    yield _counter("weightsync_wire_bytes", "What was sent, once per member reached (a delta's size where it "
                   "went as one)", ch, s.bytes_on_wire)
    evictions = CounterMetricFamily("weightsync_evictions", "Members dropped, by reason", labels=["channel", "reason"])
    for reason in ("dead", "failed", "slow", "operator", *sorted(set(s.evictions) - {"dead", "failed", "slow",
                                                                                      "operator"})):
        evictions.add_metric([s.channel, reason], s.evictions.get(reason, 0))
    yield evictions
    yield _gauge("weightsync_generation", "The current generation number", ch, s.generation)
    yield _gauge("weightsync_members", "Members of the current generation", ch, len(s.members))
    yield _summary("weightsync_put_stall_seconds", "How long put() held the caller", ch, s.put_stall)
    yield _summary("weightsync_delivery_seconds", "From the start of sending to the last acknowledgement", ch,
                   s.delivery)
    lag = GaugeMetricFamily("weightsync_member_lag_versions", "Versions a member is behind the newest put",
                            labels=["channel", "member"])
    last = GaugeMetricFamily("weightsync_member_version", "The newest version a member acknowledged",
                             labels=["channel", "member"])
    took = GaugeMetricFamily("weightsync_member_receive_seconds", "How long a member's last version took it",
                             labels=["channel", "member"])
    for m in s.members:
        if m.lag is not None:
            lag.add_metric([s.channel, m.member_id], m.lag)
        if m.last_version is not None:
            last.add_metric([s.channel, m.member_id], m.last_version)
        if m.last_receive_seconds is not None:
            took.add_metric([s.channel, m.member_id], m.last_receive_seconds)
    yield from (lag, last, took)


def subscriber_metrics(s: SubscriberStatistics) -> Iterator[Metric]:
    labels = {"channel": s.channel, "member": s.member_id}
    for field, doc in (("versions_received", "Versions made readable"),
                       ("receive_failures", "Versions whose receive failed"),
                       ("checksum_failures", "Versions whose bytes did not match the publisher's digests"),
                       ("reads", "Reads that returned a version"),
                       ("reads_skipped", "get_into(only_newer=True) calls that copied nothing"),
                       ("reads_as_received", "get_into(as_received=True) calls written as the version arrived")):
        yield _counter(f"weightsync_subscriber_{field}", doc, labels, getattr(s, field))
    yield _counter("weightsync_subscriber_received_bytes", "Payload bytes received", labels, s.bytes_received)
    yield _gauge("weightsync_subscriber_version", "The latest readable version (-1: none yet)", labels,
                 -1 if s.version is None else s.version)
    yield _gauge("weightsync_subscriber_evicted", "1 once the publisher dropped this subscriber", labels,
                 int(s.evicted))
    yield _summary("weightsync_subscriber_receive_seconds", "From the Announce to the version being readable",
                   labels, s.receive)


class WeightsyncCollector(Collector):
    """A custom collector over one end's ``statistics()`` (a Publisher or a Subscriber)."""

    def __init__(self, end: Any) -> None:
        if not callable(getattr(end, "statistics", None)):
            raise TypeError(f"expected a weightsync Publisher or Subscriber, got {type(end).__name__}")
        self._end = end

    def collect(self) -> Iterator[Metric]:
        stats = self._end.statistics()
        if isinstance(stats, PublisherStatistics):
            yield from publisher_metrics(stats)
        else:
            yield from subscriber_metrics(stats)


def register(end: Any, registry: CollectorRegistry | None = None) -> WeightsyncCollector:
    """Export ``end``'s statistics through ``registry`` (default: prometheus_client's global one).

    Returns the collector (:func:`unregister` removes it). An end registered twice with one
    registry is refused (``ValueError``): its every series would be exported twice.
    """
    collector = WeightsyncCollector(end)
    target = REGISTRY if registry is None else registry
    with _lock:
        ends = _registered.setdefault(target, weakref.WeakSet())
        if end in ends:  # prometheus_client cannot see it (our collector describes nothing): every series twice
            raise ValueError(f"{type(end).__name__} of channel {getattr(end, 'name', '?')!r} is already registered "
                             "with this registry; unregister the collector register() returned first")
        target.register(collector)
        ends.add(end)
    return collector


def unregister(collector: WeightsyncCollector, registry: CollectorRegistry | None = None) -> None:
    """Stop exporting the end ``collector`` was made for (what :func:`register` returned)."""
    target = REGISTRY if registry is None else registry
    with _lock:
        target.unregister(collector)
        _registered.get(target, weakref.WeakSet()).discard(collector._end)


_lock = threading.Lock()
_registered: weakref.WeakKeyDictionary[Any, weakref.WeakSet[Any]] = weakref.WeakKeyDictionary()
