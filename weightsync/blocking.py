"""The blocking API: :class:`BlockingPublisher` and :class:`BlockingSubscriber`.

For training and generation loops without an event loop (most of them). Each object runs the
asynchronous :class:`~weightsync.Publisher` or :class:`~weightsync.Subscriber` on a private
event loop in a daemon thread of its own (``ws-<channel>-blocking``) and forwards every call
to it, as httpx's ``Client`` sits beside its ``AsyncClient``: the same names, arguments,
errors and guarantees, with ``close()`` for ``aclose()`` and plain context managers::

    with ws.BlockingPublisher("policy", address="0.0.0.0:0") as pub:
        pub.wait_subscribers(2, timeout=60)
        for step in range(steps):
            train_step(model)                          # holds this thread, not weightsync's
            handle = pub.put(model.state_dict(), version=step)
        handle.delivered(timeout=30)

    with ws.BlockingSubscriber("policy", address=addr) as sub:
        for weights in sub.updates():
            sample_with(weights)

Every call is bounded. A call given a ``timeout`` waits at most that long (plus a second
for the hand-over between threads, after which :class:`~weightsync.SyncTimeout` is raised and
the call is cancelled); one without waits as its asynchronous twin does, whose own deadlines
(the publisher's liveness, the sender's bounds) end it, in one-second slices that notice a
dead loop thread. An interrupt (Ctrl-C) in the caller cancels the call it interrupted.

Because the channel's threads and loop are weightsync's own, a training step that holds the
caller's thread for minutes delays nothing: members are admitted, dead ones evicted and
replaced, versions delivered and timed meanwhile.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import torch

from weightsync.engine.handles import DeliveryReport, PutHandle, Weights, WeightStream, check_timeout
from weightsync.errors import Closed, SyncTimeout
from weightsync.format import layout
from weightsync.membership.membership import MemberInfo
from weightsync.options import Deadlines
from weightsync.statistics import PublisherStatistics, SubscriberStatistics
from weightsync.transport.loopthread import LoopThread
from weightsync.transport.publisher import Publisher
from weightsync.transport.subscriber import Subscriber

T = TypeVar("T")
HANDOVER = 1.0  # seconds a call may take beyond its own timeout (the thread hand-over)
SLICE = 1.0  # an unbounded call is waited for in slices of this, checking the loop thread


class _Bridge:
    """One loop thread and the bounded calls into it."""

    def __init__(self, name: str) -> None:
        self.thread = LoopThread(name)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None, what: str) -> T:
        """Run ``coro`` on the loop; ``timeout`` (plus the hand-over) bounds it, None: its own deadlines."""
        if not self.thread.alive:  # closed: what the asynchronous end raises once closed
            coro.close()
            raise Closed(f"{what}: this blocking end is closed")
        future: concurrent.futures.Future[T] = self.thread.submit(coro)
        limit = None if timeout is None else timeout + HANDOVER
        waited = 0.0
        try:
            while True:
                step = SLICE if limit is None else min(SLICE, max(limit - waited, 0.0))
                try:
                    return future.result(timeout=step)
                except concurrent.futures.TimeoutError:
                    waited += step
                    if not self.thread.alive:
                        raise Closed(f"{what}: the weightsync loop thread has stopped") from None
                    if limit is not None and waited >= limit:
                        future.cancel()
                        raise SyncTimeout(f"{what} did not finish within {timeout:.3g}s") from None
        except BaseException:  # an interrupt in the caller ends the call it interrupted
            future.cancel()
            raise

    def close(self) -> None:
        self.thread.close()


class BlockingPutHandle:
    """:class:`~weightsync.PutHandle` for blocking code: ``delivered()`` and ``released()`` wait."""

    def __init__(self, handle: PutHandle, bridge: _Bridge) -> None:
        self._handle, self._bridge = handle, bridge
        self.version = handle.version
        self.channel = handle.channel

    def delivered(self, timeout: float | None = None, *, min_members: int = 0) -> DeliveryReport:
        """The DeliveryReport (``NotDelivered`` below ``min_members``); SyncTimeout after ``timeout``."""
        check_timeout("timeout", timeout)
        return self._bridge.call(self._handle.delivered(timeout, min_members=min_members), timeout,
                                 f"version {self.version}'s delivery")

    def released(self, timeout: float | None = None, *, spill: bool = False) -> None:
        """With ``copy=False``: returns once the caller may change its tensors again (``spill``: see
        :meth:`weightsync.PutHandle.released`)."""
        check_timeout("timeout", timeout)
        self._bridge.call(self._handle.released(timeout, spill=spill), timeout, f"version {self.version}'s release")

    def done(self) -> bool:
        return self._handle.done()

    def __repr__(self) -> str:
        return f"Blocking{self._handle!r}"


E = TypeVar("E", bound="_BlockingEnd")


class _BlockingEnd:
    """What both blocking ends share: the context manager, and closing the loop thread after the end."""

    _bridge: _Bridge

    def start(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError

    def __enter__(self: E) -> E:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.abort()

    _start_tried = False

    def _started(self, coro: Coroutine[Any, Any, None], what: str) -> None:
        """Start the end; its loop thread goes if it does not. A second start() is refused and
        leaves the running end alone (it once closed the loop thread of a running subscriber)."""
        if self._start_tried:
            coro.close()
            state = "running" if self._bridge.thread.alive else "closed"
            raise Closed(f"{what}: a blocking end starts once (this one is {state})")
        self._start_tried = True
        try:
            self._bridge.call(coro, None, what)
        except BaseException:
            self._bridge.close()
            raise

    def _ended(self, coro: Coroutine[Any, Any, None], bound: float | None, what: str) -> None:
        """Close or abort the end (idempotent), then its loop thread."""
        if not self._bridge.thread.alive:
            coro.close()
            return
        try:
            self._bridge.call(coro, bound, what)
        finally:
            self._bridge.close()


class _PublisherEnd(_BlockingEnd):
    """What both blocking publishers share: starting, stopping, the members and waiting for them."""

    _pub: Publisher
    _timeout: float

    def start(self) -> None:
        """Listen and start the sender; a sharded rank waits for its peers here (bounded)."""
        self._started(self._pub.start(), "starting the publisher")

    def close(self, timeout: float | None = None) -> None:
        """Send what is pending (bounded by its deadlines), tell subscribers, stop. Idempotent."""
        check_timeout("timeout", timeout)
        self._ended(self._pub.aclose(timeout), None if timeout is None else timeout + HANDOVER,
                    "closing the publisher")

    def abort(self) -> None:
        """Stop at once: pending puts fail with Closed. Idempotent."""
        self._ended(self._pub.abort(), Deadlines.aborting(self._timeout), "aborting the publisher")

    @property
    def address(self) -> str:
        return self._pub.address

    @property
    def members(self) -> tuple[str, ...]:
        return self._pub.members

    def statistics(self) -> PublisherStatistics:
        return self._pub.statistics()

    def wait_subscribers(self, n: int, timeout: float | None = None) -> tuple[str, ...]:
        """Wait until at least ``n`` subscribers are in (default bound: the publisher's timeout)."""
        check_timeout("timeout", timeout)
        bound = self._timeout if timeout is None else timeout
        return self._bridge.call(self._pub.wait_subscribers(n, timeout), bound, f"waiting for {n} subscribers")


class BlockingPublisher(_PublisherEnd):
    """A :class:`~weightsync.Publisher` for code without an event loop (see the module docstring).

    Takes every argument the Publisher takes. ``start()`` (or ``with``) starts it; ``close()``
    sends what is pending and stops; ``abort()`` stops at once.
    """

    def __init__(self, name: str, **kwargs: Any) -> None:
        self._pub = Publisher(name, **kwargs)
        self._bridge = _Bridge(f"ws-{name}-blocking")
        self.name = name
        self._timeout = self._pub.options.timeout

    @property
    def generation(self) -> int:
        return self._pub.generation

    @property
    def version(self) -> int | None:
        return self._pub.version

    @property
    def evicted(self) -> list[MemberInfo]:
        return self._pub.evicted

    @property
    def settings(self) -> Any:
        return self._pub.settings

    @property
    def orchestrator(self) -> Any:
        return self._pub.orchestrator

    @orchestrator.setter
    def orchestrator(self, value: Any) -> None:
        self._pub.orchestrator = value

    def put(self, tensors: layout.TensorsLike, *, version: int | None = None, copy: bool = True,
            owners: Mapping[str, int] | None = None, dtype: layout.CastLike = None,
            encoding: str | None = None, quantize: str | None = None) -> BlockingPutHandle:
        """Queue a version; returns once the snapshot is taken (as :meth:`Publisher.put`)."""
        handle = self._bridge.call(self._pub.put(tensors, version=version, copy=copy, owners=owners, dtype=dtype,
                                                 encoding=encoding, quantize=quantize), None, "put")
        return BlockingPutHandle(handle, self._bridge)

    def evict(self, member_id: str, reason: str = "operator") -> None:
        self._bridge.call(self._pub.evict(member_id, reason), self._timeout, f"evicting {member_id}")

    def peak_snapshots(self) -> int:
        return self._pub.peak_snapshots()


class BlockingAdapterPublisher(_PublisherEnd):
    """A :class:`~weightsync.AdapterPublisher` for code without an event loop: ``put(name, adapter)``
    and ``remove(name)`` return a :class:`BlockingPutHandle`; ``adapters``, ``address``,
    ``wait_subscribers`` and ``statistics()`` as on the blocking publisher."""

    def __init__(self, name: str, **kwargs: Any) -> None:
        from weightsync.adapters import AdapterPublisher

        self._adapters = AdapterPublisher(name, **kwargs)
        self._pub = self._adapters.publisher
        self._bridge = _Bridge(f"ws-{name}-blocking")
        self.name = name
        self._timeout = self._pub.options.timeout

    @property
    def adapters(self) -> dict[str, int]:
        return self._adapters.adapters

    def put(self, name: str, adapter: Any, *, version: int | None = None,
            dtype: torch.dtype | None = None) -> BlockingPutHandle:
        """Send a version of adapter ``name`` (as :meth:`AdapterPublisher.put`)."""
        handle = self._bridge.call(self._adapters.put(name, adapter, version=version, dtype=dtype), None, "put")
        return BlockingPutHandle(handle, self._bridge)

    def remove(self, name: str) -> BlockingPutHandle:
        """Drop adapter ``name`` from the channel (as :meth:`AdapterPublisher.remove`)."""
        return BlockingPutHandle(self._bridge.call(self._adapters.remove(name), None, "remove"), self._bridge)


class BlockingSubscriber(_BlockingEnd):
    """A :class:`~weightsync.Subscriber` for code without an event loop (see the module docstring).

    Takes every argument the Subscriber takes. Like it, it may start before its publisher: it
    keeps trying to reach the address until its join deadline.
    """

    def __init__(self, name: str, *, address: str, **kwargs: Any) -> None:
        self._sub = Subscriber(name, address=address, **kwargs)
        self._bridge = _Bridge(f"ws-{name}-blocking")
        self.name = name
        self.member_id = self._sub.member_id

    def start(self, timeout: float | None = None) -> None:
        """Connect and join (bounded by ``timeout``, default twice the subscriber's)."""
        check_timeout("timeout", timeout)
        self._started(self._sub.start(timeout), "joining the channel")

    def close(self) -> None:
        """Finish the version in flight, leave, stop. Idempotent."""
        self._ended(self._sub.aclose(), None, "closing the subscriber")

    def abort(self) -> None:
        """Stop now, abandoning any version in flight. Idempotent."""
        self._ended(self._sub.abort(), Deadlines.aborting(self._sub.timeout), "aborting the subscriber")

    def rejoin(self, timeout: float | None = None) -> None:
        check_timeout("timeout", timeout)
        self._bridge.call(self._sub.rejoin(timeout), None, "rejoining the channel")

    @property
    def version(self) -> int | None:
        return self._sub.version

    @property
    def transport(self) -> str:
        return self._sub.transport

    @property
    def evicted(self) -> bool:
        return self._sub.evicted

    @property
    def generation(self) -> int:
        return self._sub.generation

    def statistics(self) -> SubscriberStatistics:
        return self._sub.statistics()

    def get(self, *, min_version: int | None = None, timeout: float | None = None) -> Weights:
        check_timeout("timeout", timeout)
        return self._bridge.call(self._sub.get(min_version=min_version, timeout=timeout), timeout, "get")

    def get_into(self, dest: Mapping[str, torch.Tensor], *, min_version: int | None = None,
                 timeout: float | None = None, only_newer: bool = False, as_received: bool = False) -> int:
        check_timeout("timeout", timeout)
        return self._bridge.call(self._sub.get_into(dest, min_version=min_version, timeout=timeout,
                                                    only_newer=only_newer, as_received=as_received),
                                 timeout, "get_into")

    def updates(self, *, timeout: float | None = None) -> Iterator[Weights]:
        """Each newer version, skipping ones that came in between; ends when the subscriber closes."""
        last: int | None = None
        while True:
            try:
                weights = self.get(min_version=None if last is None else last + 1, timeout=timeout)
            except Closed:
                return
            last = weights.version
            yield weights

    @contextlib.contextmanager
    def stream(self, *, min_version: int | None = None, timeout: float | None = None) -> Iterator[WeightStream]:
        """The latest version as ``(name, tensor)`` views, pinned until the block ends (no copy)."""
        check_timeout("timeout", timeout)
        manager = self._sub.stream(min_version=min_version, timeout=timeout)
        weights = self._bridge.call(manager.__aenter__(), timeout, "stream")
        try:
            yield weights
        except BaseException as err:
            self._bridge.call(manager.__aexit__(type(err), err, err.__traceback__), self._sub.timeout,
                              "ending the stream")
            raise
        else:
            self._bridge.call(manager.__aexit__(None, None, None), self._sub.timeout, "ending the stream")

    def load(self, into: Callable[[Iterable[tuple[str, torch.Tensor]]], Any], *, min_version: int | None = None,
             timeout: float | None = None) -> int:
        """Call ``into(pairs)`` (an engine's ``load_weights``) in this thread with the latest version's views."""
        if not callable(into):
            raise TypeError(f"into must be callable, e.g. model.load_weights; got {type(into).__name__}")
        with self.stream(min_version=min_version, timeout=timeout) as weights:
            into(weights)
            return weights.version
