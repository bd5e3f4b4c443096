"""Subscriber: a generator's end of a channel.

Who calls what, in order:

1. ``async with Subscriber(name, address=...)`` connects to the store and starts two
   threads: *heartbeat* (liveness beats; watches the publisher's) and *receiver*, which
   sends a Join (fingerprint, token) and waits for Admit or Deny within ``timeout``;
2. the receiver builds the dedicated group of its generation and follows the publisher's
   commands: Announce (receive the buckets straight into the receiving slot, acknowledge,
   publish atomically), Reconfigure (next generation, or Evicted), Shutdown;
3. the application reads with ``get``/``get_into``/``updates``; reads copy out of the
   readable slot in a worker thread, so the event loop never waits on a copy or the wire;
4. ``aclose()`` finishes the version in flight, leaves the channel and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from weightsync import _faults, _wire
from weightsync.errors import (
    Closed,
    Evicted,
    PublisherGone,
    SyncTimeout,
    WeightSyncError,
)
from weightsync.pg import _torch_compat as compat
from weightsync.pg import handshake
from weightsync.pg.control import ControlPlane, StoreTimeout, StoreUnreachable
from weightsync.pg.group import drain_retired, resolve_backend
from weightsync.pg.recorder import FlightRecorder, process_recorder
from weightsync.transport import layout
from weightsync.transport.handles import Weights, WeightStream, call_soon
from weightsync.transport.options import ChannelOptions, parse_address, resolve_device
from weightsync.transport.receiver import ReceiverLoop
from weightsync.transport.slots import Slot, SlotPair


class Subscriber(ReceiverLoop):
    """Receives every version of channel ``name`` in the background; reads never tear.

    Example::

        async with ws.Subscriber("policy", address=addr) as sub:
            w = await sub.get(min_version=5, timeout=30)    # Weights, owned by the caller
            v = await sub.get_into(model.state_dict())      # in place; returns the version
            async for w in sub.updates():                   # each newer version
                ...

    Args:
        name: the channel.
        address: the publisher's ``"host:port"``; or ``store=`` an existing torch Store.
        backend: must match the publisher's (``"auto"`` picks the same way).
        device: where ``get`` returns tensors (and, on NCCL, where receive slots live).
        member_id: unique name in the channel (default: ``host-pid-random``).
        timeout: seconds; floor of every deadline (join, buckets, publisher liveness).
        secret: shared secret (default ``$WEIGHTSYNC_TOKEN``).
        flight_recorder_dir: where dumps go (default ``$WEIGHTSYNC_FR_DIR``, else the same
            per-run directory under the system temp dir as a publisher on this host).
    """

    def __init__(self, name: str, *, address: str | None = None, store: Any = None, backend: str = "auto",
                 device: str | torch.device | None = None, member_id: str | None = None, timeout: float = 30.0,
                 min_bandwidth: float = 50e6, heartbeat_interval: float = 1.0, secret: str | bytes | None = None,
                 recorder: FlightRecorder | None = None,
                 flight_recorder_dir: str | os.PathLike[str] | None = None) -> None:
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"channel name must be a non-empty string without '/', got {name!r}")
        if (address is None) == (store is None):
            raise ValueError("pass exactly one of address= (the publisher's 'host:port') or store=")
        self.name = name
        self._connect = parse_address(address) if address is not None else None
        self._user_store = store
        self.options = ChannelOptions(timeout=timeout, min_bandwidth=min_bandwidth,
                                      heartbeat_interval=heartbeat_interval)
        self.device = resolve_device(device)
        self.backend = resolve_backend(backend, self.device)
        self.member_id = member_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        if "/" in self.member_id:
            raise ValueError(f"member_id must not contain '/', got {self.member_id!r}")
        self._secret = handshake.resolve_secret(secret)
        self._recorder = recorder or process_recorder()
        default_dir = f"{name}-{address.replace(':', '-')}" if address else f"{name}-pid{os.getpid()}"
        self._recorder.configure(directory=flight_recorder_dir, label=self.member_id, default_directory=default_dir)
        self._slots = SlotPair(self.device if self.backend == "nccl" else torch.device("cpu"))
        self._state = "new"
        self._terminal: tuple[type[WeightSyncError], str] | None = None
        self._closing = threading.Event()
        self._abort = threading.Event()
        self._joined = threading.Event()
        self._join_error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._threads: list[threading.Thread] = []
        self.generation = -1
        self.rank = -1
        self._clean_shutdown = False
        self._faults = _faults.from_env()
        self._backend = None
        self._slot = 0

    # lifecycle ----------------------------------------------------------------------------
    async def __aenter__(self) -> Subscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await (self.aclose() if exc[0] is None else self.abort())

    async def start(self, timeout: float | None = None) -> None:
        """Connect, join (handshake, token) and start receiving; raises if admission fails."""
        if self._state != "new":
            raise RuntimeError("a Subscriber starts once")
        self._state = "running"
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"ws-{self.name}-read")
        limit = timeout if timeout is not None else 2 * self.options.timeout
        try:
            store = await self._loop.run_in_executor(self._executor, self._open_store)
        except Exception as err:
            self._state = "closed"
            self._executor.shutdown(wait=False)
            raise PublisherGone(f"cannot reach the publisher's store: {err}", channel=self.name,
                                member=self.member_id) from err
        self._ctl = ControlPlane(store, self.name)
        await self._launch(limit)

    async def _launch(self, limit: float) -> None:
        """Start the heartbeat and receiver threads on a fresh queue and wait for admission."""
        assert self._loop is not None
        self._queue = self._ctl.member_queue(self.member_id, uuid.uuid4().hex[:12])
        roles = ((self._heartbeat_main, "heartbeat"), (self._receiver_main, "receiver"))
        clones = await self._loop.run_in_executor(
            self._executor, lambda: [self._ctl.clone(self.options.timeout) for _ in roles])
        self._threads = []
        for (target, role), ctl in zip(roles, clones, strict=True):
            thread = threading.Thread(target=target, args=(ctl,), name=f"ws-{self.name}-{role}", daemon=True)
            thread.start()
            self._threads.append(thread)
        joined = await self._loop.run_in_executor(None, self._joined.wait, limit)
        if self._join_error is not None or not joined:
            await self.abort()
            if self._join_error is not None:
                raise self._join_error
            raise SyncTimeout(f"not admitted within {limit:.3g}s", channel=self.name, member=self.member_id)

    def _open_store(self) -> Any:
        if self._user_store is not None:
            return self._user_store
        assert self._connect is not None
        return compat.new_store_client(self._connect[0], self._connect[1], self.options.timeout)

    @property
    def evicted(self) -> bool:
        """True once the publisher dropped this subscriber: new waits raise Evicted; see rejoin()."""
        return self._terminal is not None and self._terminal[0] is Evicted

    async def rejoin(self, timeout: float | None = None) -> None:
        """Join again after :class:`Evicted`; the last complete version stays readable meanwhile.

        Raises RuntimeError when this subscriber was not evicted, and what ``start`` raises
        when admission fails (the subscriber is then closed).
        """
        if self._state != "running" or not self.evicted:
            raise RuntimeError("rejoin() is for a running subscriber that was evicted")
        assert self._loop is not None
        deadline = time.monotonic() + self.options.timeout
        for thread in self._threads:  # both end on their own once evicted
            await self._loop.run_in_executor(None, thread.join, max(deadline - time.monotonic(), 0.01))
            if thread.is_alive():
                raise SyncTimeout(f"{thread.name} did not stop within {self.options.timeout}s", channel=self.name,
                                  member=self.member_id)
        self._terminal, self._join_error = None, None
        self._joined.clear()
        await self._launch(timeout if timeout is not None else 2 * self.options.timeout)
        self._recorder.record("rejoin", channel=self.name, member=self.member_id,
                              version=-1 if self.version is None else self.version).complete()

    async def aclose(self) -> None:
        """Finish the version in flight, leave the channel, stop. Idempotent."""
        if self._state in ("new", "closed"):
            self._state = "closed"
            return
        self._state = "closing"
        self._closing.set()
        await self._join_threads(self.options.deadline(64 << 20) * 2)

    async def abort(self) -> None:
        """Stop now, abandoning any version in flight. Idempotent."""
        if self._state in ("new", "closed"):
            self._state = "closed"
            return
        self._state = "closing"
        self._abort.set()
        self._closing.set()
        await self._join_threads(self.options.timeout)

    async def _join_threads(self, timeout: float) -> None:
        assert self._loop is not None
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            await self._loop.run_in_executor(None, thread.join, max(deadline - time.monotonic(), 0.01))
        self._set_terminal(Closed, "subscriber closed")
        if self._executor is not None:
            self._executor.shutdown(wait=False)
        # retired groups finish tearing down before we return (bounded): see group._Reaper
        await self._loop.run_in_executor(None, drain_retired, self.options.timeout * 3)
        if self._recorder.last_dump_path is not None:  # trouble was dumped: leave the full story
            self._recorder.dump_on_trouble("closed after trouble", force=True)
        self._state = "closed"

    # reading ------------------------------------------------------------------------------
    @property
    def version(self) -> int | None:
        """The latest complete version, or None before the first one."""
        return self._slots.version

    async def get(self, *, min_version: int | None = None, timeout: float | None = None) -> Weights:
        """A copy of the latest version (>= ``min_version``), owned by the caller.

        ``timeout=None`` waits while the publisher is alive: its heartbeats are watched, so a
        dead or frozen publisher ends the wait with PublisherGone.
        """
        await self._wait_version(min_version, timeout)
        assert self._loop is not None
        slot = self._slots.pin()
        try:
            flat, manifest, version = await self._loop.run_in_executor(None, self._copy_out, slot)
        finally:
            self._slots.unpin(slot)
        return Weights(version, layout.views(flat, manifest), manifest.total_bytes)

    async def get_into(self, dest: Mapping[str, torch.Tensor], *, min_version: int | None = None,
                       timeout: float | None = None) -> int:
        """Copy the latest version into ``dest`` in place; returns its version.

        Names, dtypes and shapes are checked first: on any mismatch ManifestMismatch is
        raised and ``dest`` is left untouched.
        """
        if not isinstance(dest, Mapping):
            raise TypeError(f"dest must be a Mapping[str, Tensor], got {type(dest).__name__}")
        await self._wait_version(min_version, timeout)
        assert self._loop is not None
        slot = self._slots.pin()
        try:
            assert slot.manifest is not None and slot.flat is not None and slot.version is not None
            layout.check_destination(slot.manifest, dest)
            await self._loop.run_in_executor(None, self._copy_into, slot, dest)
            return slot.version
        finally:
            self._slots.unpin(slot)

    @contextlib.asynccontextmanager
    async def stream(self, *, min_version: int | None = None,
                     timeout: float | None = None) -> AsyncIterator[WeightStream]:
        """The latest version (>= ``min_version``) as ``(name, tensor)`` views, without a copy.

        For engines that load weights from an iterator (vLLM's ``model.load_weights``)::

            async with sub.stream(min_version=v) as weights:
                await asyncio.to_thread(model.load_weights, weights)

        The version stays readable and unchanged inside the block (the receiver writes the
        next one into the other slot, and waits at most its deadline for this one); the
        views must not be used after it.
        """
        await self._wait_version(min_version, timeout)
        slot = self._slots.pin()
        try:
            assert slot.flat is not None and slot.manifest is not None and slot.version is not None
            if slot.flat.is_cuda:
                torch.cuda.current_stream(slot.flat.device).synchronize()
            weights = WeightStream(slot.version, slot.flat, slot.manifest)
            try:
                yield weights
            finally:
                weights.close()
        finally:
            self._slots.unpin(slot)

    async def load(self, into: Callable[[Iterable[tuple[str, torch.Tensor]]], Any], *,
                   min_version: int | None = None, timeout: float | None = None) -> int:
        """Call ``into(pairs)`` with the latest version's ``(name, tensor)`` views; its version.

        ``into`` is an engine's weight loader (``model.load_weights``): it runs in a worker
        thread (an ``async def`` one on the loop), tensor by tensor in wire order, with no
        intermediate copy of the whole version.
        """
        if not callable(into):
            raise TypeError(f"into must be callable, e.g. model.load_weights; got {type(into).__name__}")
        async with self.stream(min_version=min_version, timeout=timeout) as weights:
            if inspect.iscoroutinefunction(into):
                await into(weights)
            else:
                assert self._loop is not None
                await self._loop.run_in_executor(None, into, weights)
            return weights.version

    async def updates(self, *, timeout: float | None = None) -> AsyncIterator[Weights]:
        """Each version newer than the last one yielded, skipping any that came in between.

        Ends when this subscriber is closed; raises PublisherGone or Evicted otherwise.
        """
        last: int | None = None
        while True:
            try:
                weights = await self.get(min_version=None if last is None else last + 1, timeout=timeout)
            except Closed:
                return
            last = weights.version
            yield weights

    def _copy_out(self, slot: Slot) -> tuple[torch.Tensor, _wire.Manifest, int]:
        assert slot.flat is not None and slot.manifest is not None and slot.version is not None
        src = slot.flat[: slot.manifest.total_bytes]
        out = torch.empty_like(src, device=self.device)
        out.copy_(src)
        if out.is_cuda:
            torch.cuda.current_stream(out.device).synchronize()
        return out, slot.manifest, slot.version

    def _copy_into(self, slot: Slot, dest: Mapping[str, torch.Tensor]) -> None:
        assert slot.flat is not None and slot.manifest is not None
        for spec in slot.manifest.tensors:
            if spec.nbytes:
                dest[spec.name].copy_(layout.tensor_view(slot.flat, spec))
        if any(t.is_cuda for t in dest.values()):
            torch.cuda.synchronize()

    async def _wait_version(self, min_version: int | None, timeout: float | None) -> None:
        if self._state == "new":
            raise RuntimeError("start the Subscriber first (async with Subscriber(...) as sub)")
        assert self._loop is not None and self._changed is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            have = self._slots.version
            if have is not None and (min_version is None or have >= min_version):
                return
            if self._terminal is not None:
                cls, message = self._terminal
                raise cls(message, channel=self.name, member=self.member_id, version=have)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self._recorder.record("get", channel=self.name, member=self.member_id,
                                      version=-1 if min_version is None else min_version).fail("deadline expired")
                self._recorder.dump_on_trouble("get deadline expired")
                raise SyncTimeout(f"version >= {min_version} not received within {timeout:.3g}s (have {have})",
                                  channel=self.name, member=self.member_id)
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                continue

    def _wake(self) -> None:
        if self._loop is not None and self._changed is not None:
            call_soon(self._loop, self._changed.set)

    def _set_terminal(self, cls: type[WeightSyncError], message: str) -> None:
        if self._terminal is None:
            self._terminal = (cls, message)
            if cls is not Closed and not self._clean_shutdown:
                self._recorder.dump_on_trouble(f"{cls.__name__}: {message}")
        self._wake()

    # heartbeat thread -------------------------------------------------------------------------
    def _heartbeat_main(self, ctl: ControlPlane) -> None:
        interval = self.options.heartbeat_interval
        last_seen, since = -1, time.monotonic()
        last_beat = since
        while not self._closing.is_set() and self._terminal is None:
            # a subscriber whose receiver stopped (evicted, failed) stops beating, so the
            # publisher drops it in a few beats instead of waiting for it
            t0 = time.monotonic()
            try:
                ctl.add(ctl.heartbeat_key(self.member_id), 1)
                publisher_beats = ctl.add(ctl.heartbeat_key("publisher"), 0)
            except (StoreTimeout, StoreUnreachable) as err:
                self._publisher_gone(ctl, f"publisher's store stopped answering: {err}")
                return
            # a store that answered late stalled for everyone: the publisher could not beat
            # either (see Membership.sample_heartbeats), so the silence restarts from now
            stalled = time.monotonic() - t0 > interval or t0 - last_beat > 2 * interval + 0.1
            last_beat = time.monotonic()
            if publisher_beats != last_seen or stalled:
                last_seen, since = publisher_beats, time.monotonic()
            elif time.monotonic() - since > max(3 * interval, self.options.timeout / 2):
                self._publisher_gone(ctl, f"publisher silent for {time.monotonic() - since:.1f}s")
                return
            self._closing.wait(interval)
        self._wake_receiver(ctl, "closing")

    def _publisher_gone(self, ctl: ControlPlane, reason: str) -> None:
        self._set_terminal(PublisherGone, reason)
        self._wake_receiver(ctl, reason)

    def _wake_receiver(self, ctl: ControlPlane, reason: str) -> None:
        try:
            ctl.push(self._queue, _wire.Wake(reason=reason))
        except (StoreTimeout, StoreUnreachable):
            pass  # the receiver's own pop fails the same way and ends
