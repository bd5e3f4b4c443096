"""The asyncio API: Publisher, Subscriber, PutHandle, Weights, manifests, buckets, staging."""

from weightsync.transport.handles import DeliveryReport, PutHandle, Weights, WeightStream
from weightsync.transport.publisher import Publisher
from weightsync.transport.subscriber import Subscriber

__all__ = ["DeliveryReport", "Publisher", "PutHandle", "Subscriber", "WeightStream", "Weights"]
