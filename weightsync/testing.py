"""Hooks for tests and fault drills; the library itself never reads them from the environment.

A test (or a drill) installs a :class:`Faults` plan on a Subscriber before it starts::

    import weightsync as ws
    from weightsync.testing import Faults, inject

    sub = ws.Subscriber("policy", address=addr)
    inject(sub, Faults(corrupt={3}))         # flip a byte of version 3's first bucket, once
    inject(sub, Faults(slow=5.0))            # take 5x as long as the wire over every bucket

What each fault does, where a real failure would hit:

- ``slow=F``: after each bucket, the receiver sleeps ``(F - 1)`` times as long as the bucket
  took (at least 20 ms each), as a member on a busy host would;
- ``corrupt={V, ...}``: one byte of bucket 0 is flipped the first time version V arrives, as a
  bad link would; the checksum must catch it, and the re-send must deliver V intact;
- ``ignore_commits=True`` (``activation="all"``): the member stages every version and keeps
  beating, but drops each Commit unanswered (an insider that holds the fleet's deliveries up);
- ``stop_after_stage=V`` / ``kill_after_stage=V`` (``activation="all"``): the member's own
  process is frozen with SIGSTOP / killed with SIGKILL right after it staged version V, before
  it acknowledges it: a real signal at a point a test cannot hit from outside.

Without ``inject`` a Subscriber runs :class:`Hooks`, which does nothing.

A test suite that runs its subscribers over one transport (the group, say, where links are
timed and generations formed) sets the default that ``Subscriber(transport=None)`` takes with
:func:`set_default_transport`; users get ``"auto"``. Likewise :func:`set_default_pipeline`
decides whether ``Publisher(pipeline=None)`` pipelines its host snapshots, which users get where
the process may use 4 CPUs or more: a suite on a smaller machine can still run that way.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["Faults", "Hooks", "default_pipeline", "default_transport", "digest", "inject", "set_default_pipeline",
           "set_default_transport"]

_default_transport = "auto"
_default_pipeline: bool | None = None


def default_transport() -> str:
    """What ``Subscriber(transport=None)`` takes in this process (``"auto"`` unless a test set it)."""
    return _default_transport


def set_default_transport(name: str) -> str:
    """Make ``name`` the transport subscribers of this process take when they name none; returns the
    previous default (a test fixture restores it)."""
    global _default_transport
    previous, _default_transport = _default_transport, name
    return previous


def default_pipeline() -> bool | None:
    """What ``Publisher(pipeline=None)`` takes in this process: None (by the CPUs it may use)
    unless a test set it."""
    return _default_pipeline


def set_default_pipeline(on: bool | None) -> bool | None:
    """Make ``on`` what publishers of this process take when they name no ``pipeline`` (None: by
    the CPUs, as users get); returns the previous setting (a test fixture restores it)."""
    global _default_pipeline
    previous, _default_pipeline = _default_pipeline, on
    return previous


class Hooks:
    """What a receiver calls at its fault points; the default does nothing."""

    def after_bucket(self, version: int, index: int, bucket: torch.Tensor, seconds: float) -> None:
        """Bucket ``index`` of ``version`` arrived (in ``bucket``) after ``seconds`` on the wire."""

    def after_stage(self, version: int) -> None:
        """With ``activation="all"``: ``version`` is verified and staged, not yet acknowledged."""

    def on_commit(self, version: int) -> bool:
        """With ``activation="all"``: the Commit of ``version`` came; False drops it unanswered."""
        return True


class Faults(Hooks):
    """A fault plan (see the module docstring)."""

    def __init__(self, *, slow: float = 1.0, corrupt: Iterable[int] = (), stop_after_stage: int | None = None,
                 kill_after_stage: int | None = None, ignore_commits: bool = False) -> None:
        if slow < 1:
            raise ValueError(f"slow must be >= 1 (a factor of the wire's time), got {slow}")
        self.slow = float(slow)
        self.corrupt = set(corrupt)
        self.stop_after_stage, self.kill_after_stage = stop_after_stage, kill_after_stage
        self.ignore_commits = ignore_commits

    def on_commit(self, version: int) -> bool:
        return not self.ignore_commits  # an insider that stages, beats, and never exposes nor answers

    def after_stage(self, version: int) -> None:
        # to this very thread: it takes the signal on return from the call, so the whole process is
        # stopped (or dead) before its next line; a process-wide kill() may let this thread run on a
        # little, and acknowledge the version (seen here)
        if version == self.kill_after_stage:
            signal.pthread_kill(threading.get_ident(), signal.SIGKILL)
        if version == self.stop_after_stage:
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)  # until the test sends SIGCONT (or kills it)

    def after_bucket(self, version: int, index: int, bucket: torch.Tensor, seconds: float) -> None:
        if index == 0 and version in self.corrupt and bucket.numel():
            self.corrupt.discard(version)
            bucket[0] ^= 0xFF
        if self.slow > 1:
            time.sleep((self.slow - 1) * max(seconds, 0.02))


def inject(subscriber: Any, hooks: Hooks) -> None:
    """Install ``hooks`` on ``subscriber`` (a :class:`weightsync.Subscriber` not started yet)."""
    if not isinstance(hooks, Hooks):
        raise TypeError(f"hooks must be a weightsync.testing.Hooks, got {type(hooks).__name__}")
    if getattr(subscriber, "_started", True):
        raise RuntimeError("inject() faults before the Subscriber starts")
    subscriber._hooks = hooks


def digest(tensor: torch.Tensor, kind: str = "crc32c") -> int:
    """The per-bucket digest ``kind`` (``"crc32c"`` or ``"xxh3"``: what ``pub.digest`` names) a
    publisher seals (and a member checks) for ``tensor``'s bytes: for tests and drills that compare
    bytes the way weightsync does."""
    from weightsync.format.checksum import checksum  # noqa: PLC0415 - only when asked

    return checksum(tensor, kind)
