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
    WeightSyncError,
)
from weightsync.orchestrator import LocalProcessOrchestrator, MemberInfo, Orchestrator
from weightsync.pg.membership import StragglerPolicy
from weightsync.pg.recorder import FlightRecorder
from weightsync.transport import DeliveryReport, Publisher, PutHandle, Subscriber, Weights, WeightStream
from weightsync.transport.options import connect_store

__version__ = "0.1.0"

__all__ = [
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
    "WeightStream",
    "Weights",
    "WeightSyncError",
    "__version__",
    "connect_store",
]
