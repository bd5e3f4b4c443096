"""weightsync: one-way, asynchronous weight push from RL trainers to inference generators.

Importing this package has no side effects: no event-loop policy, no environment writes, no
logging configuration, no CUDA initialisation. It does not even import torch: every public name
below is loaded on first use (PEP 562), so ``weightsync --help`` and ``weightsync fr`` answer
without paying for torch's import (2.6-5 s on the machines here).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from weightsync.errors import (
    AdmissionDenied,
    Closed,
    EngineMismatch,
    Evicted,
    HandshakeMismatch,
    ManifestMismatch,
    NotDelivered,
    PublisherGone,
    RankMismatch,
    Superseded,
    SyncTimeout,
    TransportUnavailable,
    WeightSyncError,
)

if TYPE_CHECKING:  # what the lazy names below resolve to, for type checkers
    from weightsync.adapters import AdapterPublisher, AdapterSubscriber, AdapterVersion
    from weightsync.blocking import BlockingAdapterPublisher, BlockingPublisher, BlockingSubscriber
    from weightsync.engine.handles import DeliveryReport, PutHandle, Weights, WeightStream
    from weightsync.format.adapters import Adapter, from_peft, merge_adapter
    from weightsync.format.quantize import quantization_config, quantize
    from weightsync.membership.membership import MemberInfo, StragglerPolicy
    from weightsync.options import connect_store
    from weightsync.orchestrator import LocalProcessOrchestrator, Orchestrator
    from weightsync.recorder.recorder import FlightRecorder
    from weightsync.statistics import MemberStatistics, PublisherStatistics, SubscriberStatistics
    from weightsync.transport.publisher import Publisher
    from weightsync.transport.subscriber import Subscriber

__version__ = "0.1.0"

# public name -> the module that defines it (imported on first access)
_LAZY = {
    "Adapter": "weightsync.format.adapters",
    "AdapterPublisher": "weightsync.adapters",
    "AdapterSubscriber": "weightsync.adapters",
    "AdapterVersion": "weightsync.adapters",
    "BlockingAdapterPublisher": "weightsync.blocking",
    "BlockingPublisher": "weightsync.blocking",
    "BlockingSubscriber": "weightsync.blocking",
    "DeliveryReport": "weightsync.engine.handles",
    "FlightRecorder": "weightsync.recorder.recorder",
    "LocalProcessOrchestrator": "weightsync.orchestrator",
    "MemberInfo": "weightsync.membership.membership",
    "MemberStatistics": "weightsync.statistics",
    "Orchestrator": "weightsync.orchestrator",
    "Publisher": "weightsync.transport.publisher",
    "PublisherStatistics": "weightsync.statistics",
    "PutHandle": "weightsync.engine.handles",
    "StragglerPolicy": "weightsync.membership.membership",
    "Subscriber": "weightsync.transport.subscriber",
    "SubscriberStatistics": "weightsync.statistics",
    "WeightStream": "weightsync.engine.handles",
    "Weights": "weightsync.engine.handles",
    "connect_store": "weightsync.options",
    "from_peft": "weightsync.format.adapters",
    "merge_adapter": "weightsync.format.adapters",
    "quantization_config": "weightsync.format.quantize",
    "quantize": "weightsync.format.quantize",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'weightsync' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access is a plain lookup
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Adapter",
    "AdapterPublisher",
    "AdapterSubscriber",
    "AdapterVersion",
    "AdmissionDenied",
    "BlockingAdapterPublisher",
    "BlockingPublisher",
    "BlockingSubscriber",
    "Closed",
    "DeliveryReport",
    "EngineMismatch",
    "Evicted",
    "FlightRecorder",
    "HandshakeMismatch",
    "LocalProcessOrchestrator",
    "ManifestMismatch",
    "MemberInfo",
    "MemberStatistics",
    "NotDelivered",
    "Orchestrator",
    "Publisher",
    "PublisherGone",
    "PublisherStatistics",
    "PutHandle",
    "RankMismatch",
    "StragglerPolicy",
    "Subscriber",
    "SubscriberStatistics",
    "Superseded",
    "SyncTimeout",
    "TransportUnavailable",
    "WeightStream",
    "Weights",
    "WeightSyncError",
    "__version__",
    "connect_store",
    "from_peft",
    "merge_adapter",
    "quantization_config",
    "quantize",
]
