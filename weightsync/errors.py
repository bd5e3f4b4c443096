"""The weightsync exception tree.

Every error the library raises on purpose derives from :class:`WeightSyncError`, and
backend errors (torch's ``RuntimeError``/``DistError``, store failures) are translated at
the boundary with ``raise ... from err`` so callers never match on backend message text::

    WeightSyncError
     ├── SyncTimeout (also TimeoutError)   a wait passed its deadline
     ├── ManifestMismatch                  names/dtypes/shapes disagree with the destination
     ├── Closed                            the Publisher/Subscriber was closed
     ├── PublisherGone                     the publisher shut down or died
     ├── Evicted                           this subscriber was removed from the channel
     ├── AdmissionDenied                   the join token was missing or wrong
     ├── HandshakeMismatch                 environment fingerprints disagree
     ├── TransportUnavailable              the transport asked for cannot work here
     ├── RankMismatch                      a sharded trainer's ranks disagree about a version
     ├── NotDelivered                      a put reached fewer members than the caller required
     ├── EngineMismatch                    an engine does not hold what the version it loaded says
     └── Superseded                        get(exact=v): a newer version replaced v before it was read

Each carries optional context (``channel``, ``generation``, ``member``, ``version``) that
appears in its message and stays available as attributes.
"""

from __future__ import annotations

__all__ = [
    "AdmissionDenied",
    "Closed",
    "EngineMismatch",
    "Evicted",
    "HandshakeMismatch",
    "ManifestMismatch",
    "NotDelivered",
    "PublisherGone",
    "RankMismatch",
    "Superseded",
    "SyncTimeout",
    "TransportUnavailable",
    "WeightSyncError",
]


class WeightSyncError(Exception):
    """Root of every error weightsync raises on purpose."""

    def __init__(
        self,
        message: str,
        *,
        channel: str | None = None,
        generation: int | None = None,
        member: str | None = None,
        version: int | None = None,
    ) -> None:
        self.message = message  # without the context suffix
        self.channel = channel
        self.generation = generation
        self.member = member
        self.version = version
        ctx = [
            f"{key}={value}"
            for key, value in (
                ("channel", channel),
                ("generation", generation),
                ("member", member),
                ("version", version),
            )
            if value is not None
        ]
        super().__init__(f"{message} [{', '.join(ctx)}]" if ctx else message)


class SyncTimeout(WeightSyncError, TimeoutError):
    """A wait passed its deadline (``get``, ``delivered``, ``wait_subscribers``, a bucket)."""


class ManifestMismatch(WeightSyncError, ValueError):
    """Tensor names, dtypes or shapes disagree; the destination was left untouched."""


class Closed(WeightSyncError):
    """The Publisher or Subscriber was closed before or during the call."""


class PublisherGone(WeightSyncError):
    """The publisher shut down or stopped answering; the last complete version stays readable."""


class Evicted(WeightSyncError):
    """This subscriber was removed from the channel; the last complete version stays readable."""


class AdmissionDenied(WeightSyncError):
    """The publisher refused the join (missing or wrong token, or a closed channel)."""


class HandshakeMismatch(WeightSyncError):
    """Publisher and subscriber environments disagree (torch, NCCL, device kind, NCCL_* vars)."""


class TransportUnavailable(WeightSyncError):
    """The transport asked for cannot work here (``transport="shm"`` with a publisher on another host)."""


class RankMismatch(WeightSyncError):
    """The trainer ranks disagree about a version (its number, tensors or who sends which bytes)."""


class NotDelivered(WeightSyncError):
    """``handle.delivered(min_members=n)``: the version reached fewer than ``n`` members.

    ``report`` is the :class:`~weightsync.DeliveryReport` it did get (``report.members`` may be
    empty: a put with no subscriber is delivered to nobody).
    """

    def __init__(self, message: str, *, report: object = None, **ctx: object) -> None:
        super().__init__(message, **ctx)  # type: ignore[arg-type]
        self.report = report


class Superseded(WeightSyncError):
    """``get(exact=v)``: a newer version replaced ``v`` here before it was read (latest wins: a
    member never keeps an older version for a reader that asked for it)."""


class EngineMismatch(WeightSyncError):
    """An inference engine does not hold what the version it loaded says: an engine parameter the
    update did not write, or engine-side bytes that differ from an engine loaded from the same
    checkpoint (the drill). The message names the parameters."""
