"""Values the public API hands back: PutHandle, DeliveryReport, Weights.

Threads never touch asyncio objects directly: they resolve handles through
``loop.call_soon_threadsafe`` (``lifecycle.call_soon``), so the event loop never blocks on the
wire and a closed loop is not an error for a background thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator, Iterator, Mapping
from typing import Any, TypeVar

import msgspec
import torch

from weightsync._wire import Manifest
from weightsync.errors import SyncTimeout
from weightsync.transport import layout
from weightsync.transport.lifecycle import call_soon

T = TypeVar("T")


class DeliveryReport(msgspec.Struct, frozen=True):
    """What became of one put.

    Attributes:
        version: the version that was put.
        members: ids of the subscribers that have it (complete and readable).
        nbytes: payload bytes sent per subscriber (0 when superseded).
        seconds: from the start of sending to the last acknowledgement.
        superseded: True when a newer put replaced it before it was sent.
    """

    version: int
    members: tuple[str, ...]
    nbytes: int
    seconds: float
    superseded: bool = False


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

    async def delivered(self, timeout: float | None = None) -> DeliveryReport:
        """The DeliveryReport; SyncTimeout if it is not known within ``timeout`` seconds."""
        return await wait_future(self._delivered, timeout, "delivery", channel=self.channel, version=self.version)

    async def released(self, timeout: float | None = None) -> None:
        """With ``copy=False``: resolves once the caller may change its tensors again."""
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


class WeightStream:
    """One complete version as ``(name, tensor)`` pairs in wire order, without a copy.

    The tensors are views into the subscriber's readable slot, which stays pinned (the
    receiver will not overwrite it) until the ``async with sub.stream()`` block ends: copy
    what you keep (an engine's ``load_weights`` does) and do not hold the views past it.
    Iterating after the block raises RuntimeError.
    """

    def __init__(self, version: int, flat: torch.Tensor, manifest: Manifest) -> None:
        self.version = version
        self.nbytes = manifest.total_bytes
        self._flat: torch.Tensor | None = flat
        self._manifest = manifest

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for spec in self._manifest.tensors:
            if self._flat is None:
                raise RuntimeError("this WeightStream ended with its 'async with sub.stream()' block")
            yield spec.name, layout.tensor_view(self._flat, spec)

    def __len__(self) -> int:
        return len(self._manifest.tensors)

    def close(self) -> None:
        self._flat = None

    def __repr__(self) -> str:
        return f"WeightStream(version={self.version}, tensors={len(self)}, nbytes={self.nbytes})"
