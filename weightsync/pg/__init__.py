"""Dedicated process groups: generations, membership, flight recorder, torch compatibility."""

from weightsync.pg.group import DedicatedGroup, resolve_backend
from weightsync.pg.recorder import Entry, FlightRecorder, process_recorder

__all__ = ["DedicatedGroup", "Entry", "FlightRecorder", "process_recorder", "resolve_backend"]
