"""Internal errors: what went wrong inside, and whose fault it is.

The public tree (:mod:`weightsync.errors`) is what callers see. Inside, every failure is
classified once, where it happens, by who is to blame, so that only a peer's failure can ever
cost a peer a strike or an eviction::

    InternalError
     ├── PeerFailure        a peer broke a data-plane step (silent, reset, late, corrupt bytes):
     │    │                 the members that did not answer may be blamed
     │    └── ChecksumMismatch   received buckets differ from the publisher's digests
     ├── Cancelled          this side gave up on purpose (a new generation, an abort): no blame
     ├── LocalFailure       this process's own input or code failed (packing a tensor, a bad
     │                      view): the put fails with it; no member is blamed
     ├── ProtocolError      a message that contradicts the protocol (bucket count, stale seal)
     └── ControlFailure     the control connection
          ├── StoreTimeout       an answer did not come in time
          ├── StoreUnreachable   the connection closed or could not be made
          │    ├── NotListening  nothing accepted the connection (a publisher not up yet)
          │    └── PublisherBusy too many connections mid-handshake there (a flood): try again
          └── StoreError         the rendezvous store's c10d adapter failed (also a RuntimeError,
               │                 as c10d expects of a store)
               └── KeyTimeout    a rendezvous key was not set within its wait

Torch backend errors (``RuntimeError``, ``DistError``) are translated into these in one place,
:mod:`weightsync.planes.group.plane` (data plane); the control plane (:mod:`weightsync.control`) raises
ControlFailure itself.
Anything else that escapes a thread is a bug in weightsync: it stops that thread and surfaces
to the caller as a :class:`~weightsync.errors.WeightSyncError`, never as a peer's fault.

The alternative rejected: classifying by builtin type (every ``RuntimeError`` a peer failure),
which turned a packing bug on the publisher into the eviction of healthy members.
"""

from __future__ import annotations

from collections.abc import Callable


class InternalError(Exception):
    """Root of the errors weightsync raises and catches inside; never seen by callers."""


class PeerFailure(InternalError):
    """A data-plane step failed because of a peer (or the link to it)."""


class ChecksumMismatch(PeerFailure):
    """A received bucket does not match the publisher's digest: the version is dropped."""


class Cancelled(InternalError):
    """A wait was given up on purpose: its generation ended, or the end is aborting."""


class LocalFailure(InternalError):
    """This process's own input or code failed; the operation's owner gets the error."""


class ProtocolError(InternalError):
    """A message that contradicts the protocol; the version it concerns is dropped."""


class ControlFailure(InternalError):
    """The control store failed."""


class StoreTimeout(ControlFailure, TimeoutError):
    """An answer on the control connection did not come within the deadline."""


class StoreUnreachable(ControlFailure, ConnectionError):
    """The control connection closed or could not be made (the other end is gone)."""


class NotListening(StoreUnreachable):
    """Nothing accepted a connection at the address (refused, unreachable): maybe not started yet."""


class PublisherBusy(StoreUnreachable):
    """The publisher turned the connection away at the door (too many mid-handshake): try again."""


class StoreError(ControlFailure, RuntimeError):
    """The rendezvous store's c10d adapter failed: the op was refused or the store is unreachable.

    A RuntimeError too, because c10d and the backends calling a store expect one (raised inside
    gloo, it comes back out of the failed work as this very object)."""


class KeyTimeout(StoreError):
    """A rendezvous key was not set within its wait."""


#: what a data-plane step may fail with without anyone's code being wrong
DATA_PLANE_FAILURES = (PeerFailure, Cancelled, ProtocolError, ControlFailure)


def own_hook(fn: Callable[[int], None] | None, i: int, what: str) -> None:
    """Run this end's own per-bucket hook (packing, checking); whatever it raises is a local
    failure, never a peer's, unless it is already classified (a same-host member late to free
    its ring slot is a PeerFailure naming it)."""
    if fn is None:
        return
    try:
        fn(i)
    except InternalError:
        raise
    except Exception as err:  # noqa: BLE001 - the caller's tensors (freed, resized), our own code
        raise LocalFailure(f"{what} bucket {i} failed: {type(err).__name__}: {err}") from err
