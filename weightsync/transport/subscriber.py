"""Subscriber: a generator's end of a channel.

Who calls what, in order:

1. ``async with Subscriber(name, address=...)`` starts its
   :class:`~weightsync.engine.receiver.Receiver`'s two threads: *heartbeat* (liveness beats;
   watches the publisher's) and *receiver*, which sends a Join (fingerprint, token) and waits
   for Admit (with the channel's settings) or Deny within ``timeout``;
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
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

import torch

from weightsync import testing
from weightsync._errors import ProtocolError, StoreUnreachable
from weightsync.control import auth
from weightsync.engine import lifecycle
from weightsync.engine.handles import Weights, WeightStream, check_timeout, time_left
from weightsync.engine.into import IntoDest
from weightsync.engine.lifecycle import EndState, call_soon
from weightsync.engine.receiver import Receiver, ReceiverState
from weightsync.engine.slots import SlotPair, copy_into, copy_out
from weightsync.errors import Closed, PublisherGone, Superseded, SyncTimeout, TransportUnavailable, WeightSyncError
from weightsync.format import layout, sharding, slicing
from weightsync.format import quantize as quantization
from weightsync.options import Deadlines, check_number, parse_address, resolve_device
from weightsync.planes.dataplane import registered_planes
from weightsync.planes.group.plane import resolve_backend
from weightsync.planes.onesided import endpoints  # light: its backend is imported when first asked for
from weightsync.recorder.recorder import FlightRecorder, process_recorder
from weightsync.statistics import SubscriberStatistics, SubscriberTally
from weightsync.testing import Hooks

TRANSPORTS = ("auto", "group", "shm", "one-sided", "cuda_ipc")
JOIN_GRACE = 1.0  # seconds past the join deadline the receiver has to say why it was not admitted

class Subscriber:
    """Receives every version of channel ``name`` in the background; reads never tear.

    Example::

        async with ws.Subscriber("policy", address=addr) as sub:
            w = await sub.get(min_version=5, timeout=30)    # Weights, owned by the caller
            v = await sub.get_into(model.state_dict())      # in place; returns the version
            async for w in sub.updates():                   # each newer version
                ...

    Bucket size, data-plane deadlines, heartbeat interval and checksums are the publisher's:
    they arrive with the admission, so nothing here has to match the publisher by hand.

    Args:
        name: the channel.
        address: the publisher's ``"host:port"`` (its ``pub.address``).
        backend: must match the publisher's (``"auto"`` picks the same way).
        device: where ``get`` returns tensors (and, on NCCL, where receive slots live).
        member_id: unique name in the channel (default: ``host-pid-random``).
        timeout: seconds; this end's own bounds: joining (twice this), and how long the
            publisher may stay silent (half of this, at least three of its heartbeats).
        secret: shared secret (default ``$WEIGHTSYNC_TOKEN``).
        flight_recorder_dir: where dumps go (default ``$WEIGHTSYNC_FR_DIR``, else the same
            per-run directory under the system temp dir as a publisher on this host).
        transport: (default ``"auto"``) ``"auto"``: the publisher's shared memory when it is on
            this host and stages in host memory, else the group; ``"group"``: always the process
            group; ``"shm"``: shared memory, or :class:`TransportUnavailable` at ``start``;
            ``"one-sided"``: read out of the publisher's memory over torch 2.15's NIXL transport
            (``weightsync[nixl]``; never picked by ``"auto"``; docs/architecture.md); ``"cuda_ipc"``
            raises :class:`TransportUnavailable`; a plane's ``register_plane`` name: that plane.
        want: a tensor-parallel engine's own tensors (names to ``DTensor`` shards on its mesh,
            or plain tensors): receive only those, each DTensor only its local shard's box,
            point to point from every trainer rank (docs/sharding.md, "Sliced receive").
            ``get``/``stream``/``load`` then give those boxes, and ``get_into(want)`` writes
            them in place. Always over the group (``transport="shm"`` is refused).
        accepts: the checkpoint format this member's engine loads (``""``: unquantized, or a
            ``put(quantize=)`` name): a ``put`` in another one is refused, naming this member.
    """

    def __init__(self, name: str, *, address: str, backend: str = "auto",
                 device: str | torch.device | None = None, member_id: str | None = None, timeout: float = 30.0,
                 secret: str | bytes | None = None, recorder: FlightRecorder | None = None,
                 flight_recorder_dir: str | os.PathLike[str] | None = None, transport: str | None = None,
                 want: Mapping[str, torch.Tensor] | None = None, accepts: str | None = None) -> None:
        lifecycle.validate_name("channel name", name)
        self._accepts = accepts if not accepts else quantization.format_of(accepts).name
        transport = transport or testing.default_transport()
        if transport not in TRANSPORTS and transport not in registered_planes():
            raise ValueError(f"transport must be one of {TRANSPORTS} or a registered plane, got {transport!r}")
        if transport == "cuda_ipc":
            raise TransportUnavailable("transport='cuda_ipc' is not built yet: CUDA subscribers receive through "
                                       "the group (NCCL); see docs/architecture.md", channel=name)
        if not isinstance(address, str):
            raise ValueError(f"address must be the publisher's 'host:port', got {address!r}")
        check_number("timeout", timeout)
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        self.name = name
        self._connect = parse_address(address)
        if self._connect[1] == 0:
            raise ValueError(f"address must name the publisher's listening port, not port 0: {address!r}")
        self.timeout = timeout
        self.device = resolve_device(device)
        self.backend = resolve_backend(backend, self.device)
        self.member_id = lifecycle.validate_name(
            "member_id", member_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
        self._secret = auth.resolve_secret(secret)
        self._recorder = recorder or process_recorder()
        self._recorder.configure(directory=flight_recorder_dir, label=self.member_id,
                                 default_directory=f"{name}-{address.replace(':', '-')}")
        self._rec = self._recorder.scope(name, self.member_id)
        self._slots = SlotPair(self.device if self.backend == "nccl" else torch.device("cpu"))
        self._want = None if want is None else slicing.wants_of(want)
        why = endpoints.refusal(transport, self._slots.device, self._want is not None)
        if why is not None:
            raise TransportUnavailable(why, channel=name)
        # the publisher's shared memory holds host bytes of whole tensors: a member receiving into a
        # device, or receiving slices, takes the group instead
        if transport == "auto" and (self._slots.device.type != "cpu" or self._want is not None):
            transport = "group"
        self._transport = transport
        self._state = EndState.NEW
        self._started = False
        self._hooks = Hooks()
        self._receiver: Receiver | None = None
        self._receivers: list[Receiver] = []  # lane 0 (the address) and, from a sharded publisher, every rank's
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None
        self._threads: list[Any] = []
        self._tally = SubscriberTally()
        self._admitted_once = False  # from then on a publisher not listening is gone, not starting
        # the last get_into: (version, id -> (tensor ref, its in-place counter after the copy), count)
        self._written: tuple[int, dict[int, tuple[weakref.ref[torch.Tensor], int]], int] | None = None

    # lifecycle ----------------------------------------------------------------------------
    async def __aenter__(self) -> Subscriber:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await (self.aclose() if exc[0] is None else self.abort())

    async def start(self, timeout: float | None = None) -> None:
        """Connect, join (handshake, token) and start receiving; raises if admission fails."""
        if self._state is not EndState.NEW:
            raise Closed("a Subscriber starts once", channel=self.name, member=self.member_id)
        check_timeout("timeout", timeout)
        self._state, self._started = EndState.RUNNING, True
        self._loop = asyncio.get_running_loop()
        self._changed = asyncio.Event()
        self._recorder.say_where()
        await self._launch(timeout if timeout is not None else Deadlines.joining(self.timeout))

    async def _launch(self, limit: float) -> None:
        """Start a Receiver (a new connection) and wait (at most ``limit``) for its admission."""
        assert self._loop is not None
        deadline = time.monotonic() + limit
        receiver = self._receiver = self._start_receiver(self._connect, 0, limit)
        self._receivers, self._threads = [receiver], []
        self._threads = self._run(receiver)
        await self._admitted(receiver, deadline, limit)
        self._admitted_once = True
        # a sharded publisher: rank 0's Admit named the other trainer ranks; each sends its own
        # part over its own group, into the same receive slots (a version is readable once all are in)
        for lane, address in enumerate(receiver.lanes, start=1):
            try:
                host_port = parse_address(address)
            except ValueError as err:
                await self.abort()
                raise WeightSyncError(f"rank 0 named an unusable address for trainer rank {lane}: {err}",
                                      channel=self.name, member=self.member_id) from err
            other = self._start_receiver(host_port, lane, max(deadline - time.monotonic(), 1.0))
            self._receivers.append(other)
            self._threads += self._run(other)
        for other in self._receivers[1:]:
            await self._admitted(other, deadline, limit)

    def _start_receiver(self, host_port: tuple[str, int], lane: int, limit: float) -> Receiver:
        return Receiver(self.name, self.member_id, host=host_port[0], port=host_port[1], backend=self.backend,
                        device=self.device, secret=self._secret, own_timeout=self.timeout, join_timeout=limit,
                        recorder=self._recorder, slots=self._slots, on_publish=self._wake, hooks=self._hooks,
                        transport=self._transport, lane=lane, want=self._want,
                        wait_for_publisher=lane == 0 and not self._admitted_once, tally=self._tally,
                        accepts=self._accepts)

    def _run(self, receiver: Receiver) -> list[Any]:
        prefix = f"ws-{self.name}" if receiver.lane == 0 else f"ws-{self.name}-rank{receiver.lane}"
        return lifecycle.launch(((receiver.heartbeat_main, "heartbeat"), (receiver.main, "receiver")), prefix)

    async def _admitted(self, receiver: Receiver, deadline: float, limit: float) -> None:
        assert self._loop is not None
        # the receiver's own join ends at the same deadline, with the reason (it never answered, it
        # refused): a moment's grace lets that reason, not a bare timeout, reach the caller
        joined = await self._loop.run_in_executor(None, receiver.joined.wait,
                                                  max(deadline - time.monotonic(), 0.0) + JOIN_GRACE)
        if receiver.state is not ReceiverState.FOLLOWING:
            error = receiver.terminal.error
            await self.abort()
            if error is not None:
                raise error
            where = "" if receiver.lane == 0 else f" by trainer rank {receiver.lane}"
            raise SyncTimeout(f"not admitted{where} within {limit:.3g}s" if not joined else "admission failed",
                              channel=self.name, member=self.member_id)

    @property
    def transport(self) -> str:
        """How versions arrive: ``"shm"`` (the publisher's shared memory, same host) or ``"group"``."""
        return "group" if self._receiver is None else self._receiver.transport

    @property
    def evicted(self) -> bool:
        """True once the publisher dropped this subscriber: new waits raise Evicted; see rejoin()."""
        return any(r.state is ReceiverState.EVICTED for r in self._receivers)

    @property
    def generation(self) -> int:
        return -1 if self._receiver is None else self._receiver.generation

    def statistics(self) -> SubscriberStatistics:
        """A frozen snapshot of this subscriber's counters and receive times (any time)."""
        return self._tally.snapshot(channel=self.name, member_id=self.member_id, transport=self.transport,
                                    version=self.version, evicted=self.evicted)

    async def rejoin(self, timeout: float | None = None) -> None:
        """Join again after :class:`Evicted`; the last complete version stays readable meanwhile.

        Raises RuntimeError when this subscriber was not evicted, and what ``start`` raises
        when admission fails (the subscriber is then closed).
        """
        if self._state is not EndState.RUNNING or not self.evicted:
            raise RuntimeError("rejoin() is for a running subscriber that was evicted")
        assert self._loop is not None
        if not await lifecycle.join(self._loop, self._threads, time.monotonic() + self.timeout):
            raise SyncTimeout(f"the evicted receiver did not stop within {self.timeout}s", channel=self.name,
                              member=self.member_id)
        await self._launch(timeout if timeout is not None else Deadlines.joining(self.timeout))
        self._rec.record("rejoin", version=-1 if self.version is None else self.version).complete()

    async def aclose(self) -> None:
        """Finish the version in flight, leave the channel, stop. Idempotent."""
        self._state, closing = lifecycle.begin_close(self._state)
        if not closing:
            return
        assert self._receiver is not None
        for receiver in self._receivers:
            receiver.closing.set()
        deadlines = self._receiver.deadlines
        await self._close(deadlines.drain() if deadlines is not None else self.timeout)

    async def abort(self) -> None:
        """Stop now, abandoning any version in flight. Idempotent."""
        self._state, closing = lifecycle.begin_close(self._state)
        if not closing:
            return
        assert self._receiver is not None
        for receiver in self._receivers:
            receiver.aborting.set()
            receiver.closing.set()
        await self._close(self.timeout)

    async def _close(self, timeout: float) -> None:
        assert self._loop is not None and self._receiver is not None
        await lifecycle.join(self._loop, self._threads, time.monotonic() + timeout)
        for receiver in self._receivers:
            receiver.end(Closed("subscriber closed", channel=self.name, member=self.member_id))
        await lifecycle.finish_close(self._loop, None, self._recorder, Deadlines.teardown(self.timeout))
        self._state = EndState.CLOSED

    # reading ------------------------------------------------------------------------------
    @property
    def version(self) -> int | None:
        """The latest complete version, or None before the first one."""
        return self._slots.version

    async def get(self, *, min_version: int | None = None, timeout: float | None = None,
                  exact: int | None = None) -> Weights:
        """A copy of the latest version (>= ``min_version``), owned by the caller.

        ``timeout=None`` waits while the publisher is alive: its heartbeats are watched, so a
        dead or frozen publisher ends the wait with PublisherGone. ``exact=v`` waits for version
        ``v`` itself and raises :class:`~weightsync.Superseded` if a newer one is readable here
        first (latest wins: nothing keeps ``v`` for a reader that comes late).
        """
        if exact is not None:
            if min_version is not None:
                raise ValueError("get() takes min_version or exact, not both")
            lifecycle.check_version("exact", exact)
            min_version = exact
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            await self._wait_version(min_version, time_left(deadline))
            assert self._loop is not None
            read = self._slots.pin_read()
            slot, guard = read.slot, read.guard
            try:
                if exact is not None and read.version != exact:
                    raise Superseded(f"version {exact} was superseded here by version {read.version} before it was "
                                     "read", channel=self.name, member=self.member_id, version=exact)
                flat, manifest, version = await self._loop.run_in_executor(None, copy_out, read, self.device)
                intact = guard is None or guard()
            finally:
                self._slots.unpin(slot)
            if intact:
                self._tally.count("reads")
                return Weights(version, layout.views(flat, manifest), manifest.total_bytes)
            if exact is not None:
                self._check_intact(guard, version)  # raises: version ``exact`` is gone here
            min_version = await self._after_torn(version, time_left(deadline))

    async def get_into(self, dest: Mapping[str, torch.Tensor], *, min_version: int | None = None,
                       timeout: float | None = None, only_newer: bool = False, as_received: bool = False) -> int:
        """Copy the latest version into ``dest`` in place; returns its version.

        Names, dtypes and shapes are checked first: on any mismatch ManifestMismatch is
        raised and ``dest`` is left untouched. A ``DTensor`` value (a tensor-parallel engine's
        shard, on its own mesh) gets only its local shard's box of the full tensor (``Shard(d)``,
        ``Replicate()``). A subscriber made with ``want=`` received only those boxes: pass the
        same mapping (or one with the same names and local shapes).

        ``only_newer=True``: when ``dest`` already holds the latest version (this subscriber
        wrote it there, and torch's in-place counter of every tensor in it says nobody wrote
        them since), nothing is copied and that version is returned at once. The caller keeps
        no bookkeeping; a tensor changed by anyone else is written again.

        ``as_received=True``: while this call waits for a version, the receiver writes that
        version's tensors into ``dest`` as their buckets arrive, so the copy overlaps the transfer
        instead of following it. ``dest`` is the receiver's until the call ends: it may hold part
        of a version in flight, or of one that failed its checks (the call then waits on for the
        next). The call returns only a version ``dest`` holds whole and verified; if it raises
        instead (deadline, publisher gone), ``dest`` may hold part of an unverified version.
        """
        if not isinstance(dest, Mapping):
            raise TypeError(f"dest must be a Mapping[str, Tensor], got {type(dest).__name__}")
        bad = next((name for name, t in dest.items() if not isinstance(t, torch.Tensor)), None)
        if bad is not None:
            raise TypeError(f"dest[{bad!r}] must be a torch.Tensor, got {type(dest[bad]).__name__}")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            version, intact = await self._read_into(dest, min_version, time_left(deadline), only_newer, as_received)
            if intact:
                return version
            min_version = await self._after_torn(version, time_left(deadline))

    async def _read_into(self, dest: Mapping[str, torch.Tensor], min_version: int | None, timeout: float | None,
                         only_newer: bool, as_received: bool) -> tuple[int, bool]:
        """One ``get_into``: the version written into ``dest``, and False when it was read in place
        and the publisher wrote it again meanwhile (``dest`` then holds no version; ``_after_torn``
        decides what that means)."""
        into = await self._wait_into(dest, min_version, timeout, as_received)
        assert self._loop is not None
        read = self._slots.pin_read()
        slot, guard, version, manifest = read.slot, read.guard, read.version, read.manifest
        try:
            assert manifest is not None and read.flat is not None and version is not None
            if into is not None and into.done == version:  # written as it arrived, then verified
                self._remember(dest, version)
                self._tally.count("reads")
                self._tally.count("reads_as_received")
                return version, True
            if only_newer and self._holds(dest, version):
                self._tally.count("reads_skipped")
                return version, True
            if self._want is not None:  # the slot holds our boxes: write each DTensor's local tensor
                dest = {name: sharding.local_box(t)[0] if sharding.is_dtensor(t) else t for name, t in dest.items()}
            layout.check_destination(manifest, dest)
            await self._loop.run_in_executor(None, copy_into, read, dest)
            if guard is not None and not guard():
                self._written = None  # dest holds part of two versions, whatever only_newer thought
                return version, False
            self._remember(dest, version)
            self._tally.count("reads")
            return version, True
        finally:
            self._slots.unpin(slot)

    async def _wait_into(self, dest: Mapping[str, torch.Tensor], min_version: int | None,
                         timeout: float | None, as_received: bool) -> IntoDest | None:
        """Wait for a version as ``_wait_version`` does; with ``as_received``, where none is readable
        yet (and this member receives whole versions), the receiver writes the next one into
        ``dest`` meanwhile. Returns that arrangement, ended: nothing is written into ``dest``
        after this returns or raises."""
        have = self._slots.version
        if not as_received or self._want is not None or (have is not None
                                                         and (min_version is None or have >= min_version)):
            await self._wait_version(min_version, timeout)
            return None
        into = IntoDest(dest, min_version)
        self._slots.into = into
        try:
            await self._wait_version(min_version, timeout)
        finally:
            if self._slots.into is into:
                self._slots.into = None
            into.close()  # waits for the receiver's writes of one bucket at most
            if into.touched:
                self._written = None  # dest holds something else now, whatever only_newer thought
        return into

    def _remember(self, dest: Mapping[str, torch.Tensor], version: int) -> None:
        """``dest`` now holds ``version``, as torch's in-place counters say (read by ``_holds``)."""
        self._written = (version, {id(t): (weakref.ref(t), t._version) for t in dest.values()}, len(dest))

    def _holds(self, dest: Mapping[str, torch.Tensor], version: int) -> bool:
        """``dest`` is what the last ``get_into`` wrote ``version`` into, untouched since."""
        if self._written is None or self._written[0] != version or self._written[2] != len(dest):
            return False
        tensors = self._written[1]
        for tensor in dest.values():
            if self._want is not None and sharding.is_dtensor(tensor):
                tensor = sharding.local_box(tensor)[0]
            known = tensors.get(id(tensor))
            if known is None or known[0]() is not tensor or known[1] != tensor._version:
                return False
        return True

    @contextlib.asynccontextmanager
    async def stream(self, *, min_version: int | None = None, timeout: float | None = None,
                     since: int | None = None) -> AsyncIterator[WeightStream]:
        """The latest version (>= ``min_version``) as ``(name, tensor)`` views, without a copy.

        ``since``: the version the caller (an engine) holds. While this subscriber still holds that
        one too (it is the version readable just before, untouched), it stays pinned with this one
        and :meth:`WeightStream.changes` says which elements differ from it.

        For engines that load weights from an iterator (vLLM's ``model.load_weights``)::

            async with sub.stream(min_version=v) as weights:
                await asyncio.to_thread(model.load_weights, weights)

        The version stays readable and unchanged inside the block (the receiver writes the
        next one into the other slot, and waits at most its deadline for this one); the
        views must not be used after it.
        """
        await self._wait_version(min_version, timeout)
        read = self._slots.pin_read()
        slot, flat, guard = read.slot, read.flat, read.guard
        try:
            assert flat is not None and read.manifest is not None and read.version is not None
            if flat.is_cuda:
                torch.cuda.current_stream(flat.device).synchronize()
            previous = None
            if since is not None and since != read.version:
                previous = self._slots.pin_previous(since)
                if previous is not None and previous.manifest != read.manifest:
                    self._slots.unpin(previous)
                    previous = None
            held = None
            if previous is not None and since is not None and previous.flat is not None:
                held = (since, previous.flat)
            weights = WeightStream(read.version, flat, read.manifest, previous=held,
                                   previous_intact=None if previous is None else previous.guard)
            self._tally.count("reads")
            try:
                yield weights
                self._check_intact(guard, weights.version)  # what was read in place was that version all along
            finally:
                weights.close()
                if previous is not None:
                    self._slots.unpin(previous)
        finally:
            self._slots.unpin(slot)

    async def load(self, into: Callable[[Iterable[tuple[str, torch.Tensor]]], Any], *,
                   min_version: int | None = None, timeout: float | None = None, since: int | None = None) -> int:
        """Call ``into(pairs)`` with the latest version's ``(name, tensor)`` views; its version.

        ``into`` is an engine's weight loader (``model.load_weights``): it runs in a worker
        thread (an ``async def`` one on the loop), tensor by tensor in wire order, with no
        intermediate copy of the whole version.

        ``since``: the version the engine holds; where this subscriber still holds it too, only
        the tensors that changed since are handed to ``into`` (a tensor whole, as it is now);
        otherwise every tensor.
        """
        if not callable(into):
            raise TypeError(f"into must be callable, e.g. model.load_weights; got {type(into).__name__}")
        async with self.stream(min_version=min_version, timeout=timeout, since=since) as weights:
            pairs: Iterable[tuple[str, torch.Tensor]] = weights
            if since is not None and weights.since == since:
                assert self._loop is not None
                try:
                    changed = await self._loop.run_in_executor(None, weights.changed_names)
                    pairs = [(name, t) for name, t in weights if name in changed]
                except Superseded:  # version ``since`` is gone here (read in place, written again): all of it
                    pass
            if inspect.iscoroutinefunction(into):
                await into(pairs)
            else:
                assert self._loop is not None
                await self._loop.run_in_executor(None, into, pairs)
            return weights.version

    async def compare_engine(self, version: int, layout: str, digest: str, *,
                             timeout: float | None = None) -> dict[str, int]:
        """Report what the inference engine this member feeds holds after loading ``version`` (a
        digest of its engine-side weights; ``layout``: what makes two engines comparable, such as
        the model, parallel rank and dtype), and return how many members of the channel reported
        each digest for that version and layout, this one included. Engines that disagree with the
        others hold something else than they loaded (``weightsync.integrations.vllm`` acts on it).
        Bounded by ``timeout`` (default: the subscriber's); ``PublisherGone`` if the connection is gone.
        """
        check_timeout("timeout", timeout)
        lifecycle.check_version("version", version)
        for what, value in (("layout", layout), ("digest", digest)):
            if not isinstance(value, str):
                raise TypeError(f"{what} must be a str, got {type(value).__name__}")
        if self._state is not EndState.RUNNING or not self._receivers:
            raise RuntimeError("start the Subscriber first (async with Subscriber(...) as sub)")
        assert self._loop is not None
        bound = self.timeout if timeout is None else timeout
        receiver = self._receivers[0]
        try:
            return await self._loop.run_in_executor(None, receiver.client.report_engine, version, layout, digest, bound)
        except (StoreUnreachable, ProtocolError) as err:
            raise PublisherGone(f"the engine report for version {version} was not answered: {err}",
                                channel=self.name, member=self.member_id, version=version) from err

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

    async def _after_torn(self, version: int, timeout: float | None) -> int:
        """After a read in place of ``version`` that the publisher wrote again meanwhile: this member
        held it past the publisher's bound, and the publisher dropped it for that (or is about to).
        What comes next decides, within this member's own timeout: the receiver's end (Evicted, as
        the README's loop expects, or PublisherGone) is raised; a newer version is readable instead:
        its number, to read it; neither: Superseded (the caller's ``timeout`` bounds it too)."""
        bound = self.timeout if timeout is None else min(timeout, self.timeout)
        try:
            await self._wait_version(version + 1, bound)
        except SyncTimeout:
            raise Superseded(f"version {version}'s shared memory was written again by the publisher while it was "
                             "read here (this member held it past the publisher's bound)", channel=self.name,
                             member=self.member_id, version=version) from None
        return version + 1

    def _check_intact(self, guard: Callable[[], bool] | None, version: int) -> None:
        """After a read (``guard``: what it read in place, taken when it began; None: its own memory):
        Superseded if the publisher wrote that segment meanwhile (this member held it too long)."""
        if guard is not None and not guard():
            raise Superseded(f"version {version}'s shared memory was written again by the publisher while it "
                             "was read here (this member held it past the publisher's bound and was evicted)",
                             channel=self.name, member=self.member_id, version=version)


    async def _wait_version(self, min_version: int | None, timeout: float | None) -> None:
        check_timeout("timeout", timeout)
        if min_version is not None:
            lifecycle.check_version("min_version", min_version, low=-(1 << 63))
        if self._state is EndState.NEW:
            raise RuntimeError("start the Subscriber first (async with Subscriber(...) as sub)")
        assert self._loop is not None and self._changed is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            have = self._slots.version
            if have is not None and (min_version is None or have >= min_version):
                return
            error = next((r.terminal.error for r in self._receivers if r.terminal.error is not None), None)
            if error is not None:
                raise type(error)(error.message, channel=self.name, member=self.member_id, version=have)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self._rec.record("get", version=-1 if min_version is None else min_version).fail("deadline expired")
                self._recorder.dump_on_trouble("get deadline expired")
                raise SyncTimeout(f"version >= {min_version} not received within {timeout:.3g}s (have {have})",
                                  channel=self.name, member=self.member_id)
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                continue

    def _wake(self) -> None:
        if self._changed is not None:
            call_soon(self._loop, self._changed.set)
