"""Values the public API hands back: PutHandle, DeliveryReport, Weights.

Threads never touch asyncio objects directly: they resolve handles through
``loop.call_soon_threadsafe`` (``lifecycle.call_soon``), so the event loop never blocks on the
wire and a closed loop is not an error for a background thread.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Generator, Iterator, Mapping
from typing import Any, NamedTuple, TypeVar

import msgspec
import torch

from weightsync._wire import Manifest
from weightsync.engine.lifecycle import call_soon
from weightsync.errors import NotDelivered, Superseded, SyncTimeout
from weightsync.format import layout

T = TypeVar("T")


class DeliveryReport(msgspec.Struct, frozen=True):
    """What became of one put.

    Attributes:
        version: the version that was put.
        members: ids of the subscribers that have it (complete and readable).
        nbytes: payload bytes sent per subscriber (0 when superseded).
        seconds: from the start of sending to the last acknowledgement, timed on the
            publisher's sender thread (a busy event loop does not lengthen it).
        superseded: True when a newer put replaced it before it was sent.
        delivered_at: ``time.time()`` when the sender thread decided the outcome (0.0 for a
            superseded put); the handle may resolve later when the event loop is busy.
        wire_bytes: what was sent for this version, counted once per member reached: a delta's
            encoded size for a member that got the delta, ``nbytes`` for one that got it full,
            nothing for a same-host member that reads the snapshot in place (no byte moved).
        encodings: per member reached, the encoding it got (``"delta"`` or ``"full"``).
        base: the version the deltas were against (-1 when nobody got a delta).
        encode_seconds: the sender thread's time making the delta (0.0 when none was made).
        committed_at: with ``activation="all"``, ``time.time()`` when the publisher committed the
            version (every member had staged it); 0.0 with ``"each"``.
        exposure_spread: seconds between the first and the last member's word, as it reached the
            publisher, that the version is readable there: their acknowledgements with
            ``"each"``, their answers to the Commit with ``"all"``.
    """

    version: int
    members: tuple[str, ...]
    nbytes: int
    seconds: float
    superseded: bool = False
    delivered_at: float = 0.0
    wire_bytes: int = 0
    encodings: dict[str, str] = {}
    base: int = -1
    encode_seconds: float = 0.0
    committed_at: float = 0.0
    exposure_spread: float = 0.0

    @property
    def nobody(self) -> bool:
        """True when the version was sent but no member has it (a put with no subscriber)."""
        return not self.members and not self.superseded


def check_timeout(what: str, value: object, *, allow_none: bool = True) -> float | None:
    """A timeout argument: None (when allowed) or a finite number of seconds >= 0, else a clear error."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} must be a number of seconds{' or None' if allow_none else ''}, "
                        f"got {type(value).__name__}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


def time_left(deadline: float | None) -> float | None:
    """What is left of a call's timeout by ``deadline`` (monotonic; None: unbounded)."""
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


def _settle(fut: asyncio.Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
        fut.exception()  # mark retrieved: an unawaited handle must not warn at exit
    else:
        fut.set_result(result)


async def wait_future(fut: asyncio.Future[T], timeout: float | None, what: str, **ctx: Any) -> T:
    """Await ``fut`` without cancelling it on timeout; SyncTimeout names ``what``."""
    try:
        return await asyncio.wait_for(asyncio.shield(fut), timeout)
    except asyncio.TimeoutError:
        raise SyncTimeout(f"{what} did not happen within {timeout:.3g}s", **ctx) from None


class PutHandle:
    """Returned by :meth:`Publisher.put` once the snapshot is taken.

    ``await handle`` is ``await handle.delivered()``. Every handle resolves: delivered,
    superseded by a newer put, or failed with a WeightSyncError (``Closed`` when the
    publisher closed first); the sender's own deadlines bound how long that takes.
    """

    def __init__(self, channel: str, version: int, loop: asyncio.AbstractEventLoop) -> None:
        self.channel = channel
        self.version = version
        self._loop = loop
        self._delivered: asyncio.Future[DeliveryReport] = loop.create_future()
        self._released: asyncio.Future[None] = loop.create_future()
        # copy=False: the version's Job's spill_rest, weakly (a Job holds its handle: a strong
        # reference both ways kept the caller's tensors, the snapshot and any spill alive until
        # the cyclic collector ran); None once the sender let the Job go, nothing left to spill
        self._spill: Callable[[], Callable[[], None] | None] | None = None
        self._resolved = threading.Event()  # set, from any thread, once its outcome is known

    def resolved(self) -> bool:
        """Any thread: whether the outcome is known (``done()`` reads the loop's future)."""
        return self._resolved.is_set()

    async def delivered(self, timeout: float | None = None, *, min_members: int = 0) -> DeliveryReport:
        """The DeliveryReport; SyncTimeout if it is not known within ``timeout`` seconds.

        ``min_members=n``: raise :class:`NotDelivered` (carrying the report) when the version
        reached fewer than ``n`` members; a superseded put never raises it (a newer one went).
        """
        check_timeout("timeout", timeout)
        if not isinstance(min_members, int) or isinstance(min_members, bool) or min_members < 0:
            raise ValueError(f"min_members must be an int >= 0, got {min_members!r}")
        report = await wait_future(self._delivered, timeout, "delivery", channel=self.channel,
                                   version=self.version)
        if not report.superseded and len(report.members) < min_members:
            raise NotDelivered(f"version {report.version} reached {len(report.members)} of the {min_members} "
                               f"members required ({list(report.members)})", report=report,
                               channel=self.channel, version=self.version)
        return report

    async def released(self, timeout: float | None = None, *, spill: bool = False) -> None:
        """With ``copy=False``: resolves once the caller may change its tensors again.

        ``spill=True``: the caller needs them back now (its next optimizer step) and the transfer
        is not done: what is not packed for the wire yet (nor copied ahead: ``Publisher(spill_ahead=)``)
        is copied at once into memory of the publisher's (at most one snapshot; the buffer is kept
        for the next spill) and the tensors are released after that copy; the rest of the version
        goes from the copy. Without it, the tensors are released once the last bucket was packed
        from them, or once a spill ahead copied the whole version."""
        check_timeout("timeout", timeout)
        rest = self._spill() if spill and self._spill is not None and not self._released.done() else None
        if rest is not None:
            await asyncio.to_thread(rest)  # a copy: not on the event loop
        await wait_future(self._released, timeout, "release", channel=self.channel, version=self.version)

    def done(self) -> bool:
        return self._delivered.done()

    def __await__(self) -> Generator[Any, None, DeliveryReport]:
        return self.delivered().__await__()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"PutHandle(channel={self.channel!r}, version={self.version}, {state})"

    # called from sender threads -------------------------------------------
    def release_threadsafe(self) -> None:
        call_soon(self._loop, _settle, self._released, None, None)

    def resolve_threadsafe(self, report: DeliveryReport | None = None, error: BaseException | None = None) -> None:
        self._resolved.set()
        call_soon(self._loop, _settle, self._released, None, None)
        call_soon(self._loop, _settle, self._delivered, report, error)


class Weights(Mapping[str, torch.Tensor]):
    """One complete version: a read-only mapping of name -> tensor, owned by the caller.

    The tensors are views into one buffer that belongs to this object alone; nothing the
    subscriber receives later changes them.
    """

    def __init__(self, version: int, tensors: dict[str, torch.Tensor], nbytes: int) -> None:
        self._version = version
        self._tensors = tensors
        self._nbytes = nbytes

    @property
    def version(self) -> int:
        return self._version

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        return f"Weights(version={self._version}, tensors={len(self)}, nbytes={self._nbytes})"


class TensorChange(NamedTuple):
    """One tensor of a version that differs from an earlier one (:meth:`WeightStream.changes`)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    values: torch.Tensor  # the new values at ``indices``, or the whole flat tensor when indices is None
    indices: torch.Tensor | None  # flat int64 positions of the changed elements; None: the whole tensor


class WeightStream:
    """One complete version as ``(name, tensor)`` pairs in wire order, without a copy.

    The tensors are views into the subscriber's readable slot, which stays pinned (the
    receiver will not overwrite it) until the ``async with sub.stream()`` block ends: copy
    what you keep (an engine's ``load_weights`` does) and do not hold the views past it.
    Iterating after the block raises RuntimeError.
    """

    def __init__(self, version: int, flat: torch.Tensor, manifest: Manifest,
                 previous: tuple[int, torch.Tensor] | None = None,
                 previous_intact: Callable[[], bool] | None = None) -> None:
        self.version = version
        self.nbytes = manifest.total_bytes
        self._flat: torch.Tensor | None = flat
        self._manifest = manifest
        self._previous = previous
        # a previous version read in place (same host): the publisher does not keep it for us, so a
        # comparison with it counts only if its segment was not written meanwhile
        self._previous_intact = previous_intact
        #: the version :meth:`changes` is against (``stream(since=)`` while it is still held), else None
        self.since: int | None = None if previous is None else previous[0]

    def changed_names(self) -> set[str]:
        """The names of the tensors whose bytes differ from version :attr:`since` (no positions: one
        compare per tensor). RuntimeError as :meth:`changes`."""
        if self._previous is None:
            raise RuntimeError("changed_names() needs stream(since=v) while this subscriber still holds version v")
        names: set[str] = set()
        for spec in self._manifest.tensors:
            if self._flat is None:
                raise RuntimeError("this WeightStream ended with its 'async with sub.stream()' block")
            lo, hi = spec.offset, spec.offset + spec.nbytes
            if not torch.equal(self._flat[lo:hi], self._previous[1][lo:hi]):
                names.add(spec.name)
        self._check_previous()
        return names | {name for name, source in self._manifest.ties if source in names}

    def _check_previous(self) -> None:
        if self._previous_intact is not None and not self._previous_intact():
            raise Superseded(f"version {self.since} was written again by the publisher while this compared with it "
                             "(read in place; the publisher keeps only the version a member reads now): load whole",
                             version=self.since)

    def changes(self) -> list[TensorChange]:
        """The tensors whose bits differ from version :attr:`since`, with where (``stream(since=)``).

        A floating-point tensor comes with the flat indices of its changed elements and their new
        values (a sparse patch), unless a new value is NaN (sparse loaders take NaN for "unchanged"):
        then, as for other dtypes, whole (``indices`` None, ``values`` the flat tensor). Compared in
        each dtype's bits. RuntimeError without a ``since`` version, or after the block; Superseded
        when version ``since`` was read in place and the publisher wrote it again meanwhile (what it
        said would be wrong: load the version whole)."""
        if self._previous is None:
            raise RuntimeError("changes() needs stream(since=v) while this subscriber still holds version v")
        out: list[TensorChange] = []
        for spec in self._manifest.tensors:
            if self._flat is None:
                raise RuntimeError("this WeightStream ended with its 'async with sub.stream()' block")
            cur, old = layout.tensor_view(self._flat, spec), layout.tensor_view(self._previous[1], spec)
            bits = layout.BITS.get(cur.element_size())
            if bits is None or cur.numel() == 0:
                if not torch.equal(cur.reshape(-1).view(torch.uint8), old.reshape(-1).view(torch.uint8)):
                    out.append(TensorChange(spec.name, cur.dtype, tuple(cur.shape), cur.reshape(-1), None))
                continue
            where = (cur.reshape(-1).view(bits) != old.reshape(-1).view(bits)).nonzero().flatten()
            if not where.numel():
                continue
            values = cur.reshape(-1)[where]
            if cur.is_floating_point() and not bool(torch.isnan(values).any()):
                out.append(TensorChange(spec.name, cur.dtype, tuple(cur.shape), values, where))
            else:
                out.append(TensorChange(spec.name, cur.dtype, tuple(cur.shape), cur.reshape(-1), None))
        changed = {c.name for c in out}
        for name, source in self._manifest.ties:  # a tied name changed with its source
            if source in changed:
                src = next(c for c in out if c.name == source)
                out.append(TensorChange(name, src.dtype, src.shape, src.values, src.indices))
        self._check_previous()
        return out

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for spec in self._manifest.tensors:
            if self._flat is None:
                raise RuntimeError("this WeightStream ended with its 'async with sub.stream()' block")
            yield spec.name, layout.tensor_view(self._flat, spec)
        if self._manifest.ties:  # tied names last, as views of their source (sent once)
            specs = layout.spec_map(self._manifest)
            for name, _source in self._manifest.ties:
                if self._flat is None:
                    raise RuntimeError("this WeightStream ended with its 'async with sub.stream()' block")
                yield name, layout.tensor_view(self._flat, specs[name])

    def __len__(self) -> int:
        return len(self._manifest.tensors) + len(self._manifest.ties)

    def close(self) -> None:
        self._flat = None
        self._previous = None

    def __repr__(self) -> str:
        return f"WeightStream(version={self.version}, tensors={len(self)}, nbytes={self.nbytes})"
