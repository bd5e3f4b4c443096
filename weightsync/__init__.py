"""weightsync: one-way, asynchronous weight push from RL trainers to inference generators.

Importing this package has no side effects: no event-loop policy, no environment writes, no
logging configuration, no CUDA initialisation.
"""

from weightsync.errors import (
    AdmissionDenied,
    Closed,
    Evicted,
    HandshakeMismatch,
    ManifestMismatch,
    PublisherGone,
    SyncTimeout,
    TransportUnavailable,
    WeightSyncError,
)
from weightsync.orchestrator import LocalProcessOrchestrator, Orchestrator
from weightsync.pg.membership import MemberInfo, StragglerPolicy
from weightsync.pg.recorder import FlightRecorder
from weightsync.transport.handles import DeliveryReport, PutHandle, Weights, WeightStream
from weightsync.transport.options import connect_store
from weightsync.transport.publisher import Publisher
from weightsync.transport.ranks import RankMismatch
from weightsync.transport.subscriber import Subscriber

__version__ = "0.1.0"

__all__ = [
    "RankMismatch",
    "AdmissionDenied",
    "Closed",
    "DeliveryReport",
    "Evicted",
    "FlightRecorder",
    "HandshakeMismatch",
    "LocalProcessOrchestrator",
    "ManifestMismatch",
    "MemberInfo",
    "Orchestrator",
    "Publisher",
    "PublisherGone",
    "PutHandle",
    "StragglerPolicy",
    "Subscriber",
    "SyncTimeout",
    "TransportUnavailable",
    "WeightStream",
    "Weights",
    "WeightSyncError",
    "__version__",
    "connect_store",
]
