"""Publisher: the trainer's end of a channel.

Who calls what, in order:

1. the trainer enters ``async with Publisher(name, address=...)``: two components start their
   threads: the :class:`~weightsync.control.server.ControlServer` (every member's authenticated
   connection: admission, beats, replies, the data plane's rendezvous) and the
   :class:`~weightsync.engine.sender.Sender` (generations, announce, data plane,
   acknowledgements, straggler scoring); the Publisher only holds them together and talks to
   the event loop;
2. subscribers join; the sender ends the current generation and builds the next one with
   them (the publisher is always rank 0);
3. ``await pub.put(sd)`` snapshots into staging and returns a PutHandle; the sender picks
   the newest pending put, announces it to every member, moves its buckets and collects
   acknowledgements into a DeliveryReport;
4. ``aclose()`` sends what is pending, tells members the channel shut down and stops.

The event loop only ever waits on futures the threads resolve; it never touches the wire.
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from weightsync import _wire
from weightsync._errors import ControlFailure
from weightsync.control import auth
from weightsync.control.framing import MAX_FRAME
from weightsync.control.rendezvous import KeyValue
from weightsync.control.server import ControlServer
from weightsync.encodings.registry import known
from weightsync.encodings.seam import AUTO, FULL
from weightsync.engine import lifecycle
from weightsync.engine.events import Abort, Drain, Evict, PutCommitted
from weightsync.engine.handles import PutHandle, check_timeout
from weightsync.engine.lifecycle import EndState, call_soon
from weightsync.engine.sender import Sender, SenderState
from weightsync.engine.snapshots import Snapshots, default_pipeline
from weightsync.engine.staging import (
    Job,
)
from weightsync.errors import Closed, SyncTimeout, WeightSyncError
from weightsync.format import checksum as checksums
from weightsync.format import layout
from weightsync.format import quantize as quantization
from weightsync.membership import ranks
from weightsync.membership.membership import MemberInfo, Membership, StragglerPolicy
from weightsync.options import (
    ACTIVATIONS,
    ChannelOptions,
    Deadlines,
    MiB,
    advertised_host,
    check_number,
    is_loopback,
    resolve_device,
    warn_open_channel,
)
from weightsync.orchestrator import Orchestrator, Replacements
from weightsync.planes.group.plane import reconfigure_enabled, resolve_backend
from weightsync.recorder.recorder import FlightRecorder, process_recorder
from weightsync.statistics import PublisherStatistics, PublisherTally
from weightsync.transport.door import Door
from weightsync.transport.planeset import PlaneSet
from weightsync.transport.trainers import TrainerRanks


class Publisher:
    """Pushes versions of a set of tensors to every subscriber of channel ``name``.

    Example::

        async with ws.Publisher("policy", address="0.0.0.0:0") as pub:
            print(pub.address)                      # hand this to the generators
            await pub.wait_subscribers(3, timeout=60)
            handle = await pub.put(model.state_dict(), version=step)
            report = await handle                   # DeliveryReport

    Args:
        name: the channel; several channels may live in one process (each listens on its own port).
        address: ``"host:port"`` to listen on for members (port 0: any free port); default
            ``"127.0.0.1:0"``. A non-loopback address without a secret logs a warning once.
        backend: ``"auto"`` (NCCL for CUDA devices, else gloo), ``"gloo"`` or ``"nccl"``.
        device: where staging lives; ``cuda`` makes snapshots stream-ordered device copies.
        bucket_bytes: bytes per broadcast.
        timeout: seconds; floor of every deadline (see ChannelOptions).
        min_bandwidth: bytes/s below which a bucket counts as stalled.
        secret: shared secret (default: ``$WEIGHTSYNC_TOKEN``; none: an open channel). With it,
            only processes that know it are admitted, and every control message both ways is
            authenticated and fresh (see docs/security.md).
        max_snapshots: staging buffers (>= 2: one in flight, one pending).
        recorder: flight recorder (default: this process's).
        flight_recorder_dir: where dumps go (default ``$WEIGHTSYNC_FR_DIR``, else a per-run
            directory under the system temp dir, logged once).
        policy: what to do about slow and dead members (:class:`StragglerPolicy`).
        orchestrator: starts replacements for dropped members (an :class:`Orchestrator`, e.g.
            :class:`LocalProcessOrchestrator`); without one, dropped members are not replaced.
        checksum: send per-bucket digests; a subscriber never makes a version readable whose
            buckets do not match (default on: computed while the next bucket is on the wire).
        digest: which function (``"crc32c"`` or ``"xxh3"``; both ends compute what the Announce
            names). ``"auto"`` (the default): the faster one on this CPU, measured once per
            process in a few milliseconds (``$WEIGHTSYNC_DIGEST`` pins one); ``pub.digest`` says
            which.
        pipeline: send a host snapshot while it is being taken (bucket i leaves once its bytes
            are copied; ``put`` still returns after the whole snapshot). Default: on where this
            process may use at least 4 CPUs. With fewer, the copies of the send and of same-host
            members compete with the snapshot for the cores and ``put`` itself gets slower
            (measured on 2 cores: docs/benchmarks.md), so the snapshot completes first.
        spill_ahead: with ``put(copy=False)``, copy each version from its end down into a spill
            buffer while the sender sends it from the start, and release the caller's tensors
            once the whole version is copied (a failed member's re-send goes from the copy): a
            transfer that outlasts the training step no longer holds the optimizer step up for
            a copy (``released(spill=True)`` earlier copies only what neither side took yet).
            The price: a copy of the version, on a thread of its own while the step runs, into
            private memory of the version's size. Default off.
        rank, world_size: a sharded trainer (docs/sharding.md): one Publisher on every trainer
            rank, each sending only the bytes it owns over its own group. Rank 0 listens at
            ``address``; on the other ranks ``address`` is rank 0's (a fixed port, or its
            ``pub.address``), and each listens for its own subscribers' data at ``lane_address``
            (default: port 0 on the interface named by ``address``). ``world_size=1`` (the
            default) is the single-process publisher.
        group: instead of rank and world_size: a ProcessGroup of the trainer ranks; rank 0's
            address travels to the others over it (a tensor broadcast, no pickle).
        encoding: how versions go on the group's wire (``weightsync.encodings.seam``):
            ``"auto"`` (the default: each version as a delta against the last one its members all
            hold, where that is smaller, tensor by tensor; docs/deltas.md), ``"delta"`` (always a
            delta where one can be made), ``"full"`` (the staged bytes), or one registered on both
            ends. Members decode before they check the digests, which are always the staged
            bytes': a delta is proven by what it rebuilds, and a member that cannot rebuild it gets
            the version in full. With a delta encoding staging keeps one more snapshot (the base)
            while a version is in flight: at most ``max_snapshots + 1``.
        activation: when members expose a version to their readers (``get``, ``updates``,
            ``get_into``, ``stream``, ``load``, engine updates). ``"each"`` (the default): each
            member as soon as it has verified it. ``"all"``: members stage the verified version and
            expose it only when this publisher commits it, once every member of the generation
            has staged it (a member that cannot within its deadline is evicted first, and the rest
            get it again and then commit): no member exposes a version another live member will
            not. The DeliveryReport then says when it was committed and how far apart the members
            exposed it. Not yet for sharded trainers (``world_size > 1``).
        streams: gloo connections between each pair of ends of the group (1 to 8; default 2).
            Consecutive buckets take turns on them, so two in flight do not queue on one socket
            and one thread: on 2 cores, 496 MiB and 1 GiB to one or two members over gloo reached
            their models in 0.55-0.90x the time with two (docs/benchmarks.md). Every member
            builds as many (its Admit says how many). NCCL ignores it (it has its own channels).
    """

    def __init__(self, name: str, *, address: str | None = None, backend: str = "auto",
                 device: str | torch.device | None = None, bucket_bytes: int = 64 * MiB, timeout: float = 30.0,
                 min_bandwidth: float = 50e6, heartbeat_interval: float = 1.0, secret: str | bytes | None = None,
                 max_snapshots: int = 2, recorder: FlightRecorder | None = None,
                 flight_recorder_dir: str | os.PathLike[str] | None = None, policy: StragglerPolicy | None = None,
                 orchestrator: Orchestrator | None = None, checksum: bool = True,
                 pipeline: bool | None = None, rank: int | None = None, world_size: int | None = None,
                 group: Any = None, lane_address: str | None = None, encoding: str = AUTO,
                 activation: str = "each", digest: str = "auto", streams: int = 2,
                 spill_ahead: bool = False) -> None:
        lifecycle.validate_name("channel name", name)
        digest = checksums.resolve(digest)
        if not known(encoding):
            raise ValueError(f"encoding {encoding!r} is neither built in nor registered")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.rank, self.world_size = ranks.rank_and_world(rank, world_size, group)
        if activation != "each" and self.world_size > 1:
            raise ValueError(f"activation={activation!r} is not supported for sharded trainers yet (world_size "
                             f"{self.world_size}): each lane's part would need its own commit; use 'each'")
        self._group = group
        if policy is not None and not isinstance(policy, StragglerPolicy):
            raise TypeError(f"policy must be a weightsync.StragglerPolicy, got {type(policy).__name__}")
        check_number("max_snapshots", max_snapshots, integer=True)
        if max_snapshots < 2:
            raise ValueError(f"max_snapshots must be >= 2 (one in flight, one pending), got {max_snapshots}")
        if orchestrator is not None and not callable(getattr(orchestrator, "replace", None)):
            raise TypeError("orchestrator must have an async replace(member) method (see weightsync.Orchestrator)")
        self.name = name
        self.options = ChannelOptions(timeout=timeout, min_bandwidth=min_bandwidth, bucket_bytes=bucket_bytes,
                                      heartbeat_interval=heartbeat_interval, streams=streams)
        # ranks > 0: address is rank 0's, and this rank listens at its lane address
        self._bind, rank0 = ranks.addresses(self.rank, address or "127.0.0.1:0", lane_address, group)
        self.device = resolve_device(device)
        self.backend = resolve_backend(backend, self.device)
        self._slot_device = self.device if self.backend == "nccl" else torch.device("cpu")
        self._secret = auth.resolve_secret(secret)
        self._recorder = recorder or process_recorder()
        self._recorder.configure(directory=flight_recorder_dir,
                                 label="publisher" if self.world_size == 1 else f"publisher-rank{self.rank}")
        self._rec = self._recorder.scope(name, "publisher")
        self.policy = policy or StragglerPolicy()
        self.orchestrator = orchestrator
        self.settings = self.options.settings(checksum=checksum, in_place=reconfigure_enabled(self.backend),
                                              activation=activation)
        pipelined = pipeline if pipeline is not None else default_pipeline()
        deadlines = Deadlines(self.settings)
        self._state = EndState.NEW
        self._stop = threading.Event()  # everything stops (after the sender drained, or at once)
        self._table = KeyValue()
        self._door = Door(rec=self._rec, recorder=self._recorder, running=lambda: self._state is EndState.RUNNING)
        self._planes = PlaneSet(name, backend=self.backend, slot_device=self._slot_device, settings=self.settings,
                                table=self._table, recorder=self._recorder, bind_host=self._bind[0],
                                max_snapshots=max_snapshots, keep_base=encoding != FULL)
        self.encoding = encoding
        self._staging = self._planes.staging
        self._control = ControlServer(
            name, host=self._bind[0], port=self._bind[1], secret=self._secret,
            mine=auth.fingerprint(self.backend, self.device), table=self._table, recorder=self._rec,
            heartbeat_interval=self.options.heartbeat_interval, dead_after=deadlines.member_silence(),
            handshake_timeout=self.options.timeout, closing=self._closing,
            on_join=self._door.joined, on_leave=self._door.left, on_dead=self._door.died,
            shm_offer=self._planes.offer, planes=self._planes.served, unserved=self._planes.unserved,
            rank_links=self.world_size > 1 and self.rank == 0, wait_bound=deadlines.rendezvous_wait())
        self.membership = Membership(name, self._recorder, self.options.heartbeat_interval,
                                     dead_after=deadlines.member_silence(), heard=self._control.heard,
                                     stale=self._control.stale)
        self._tally = PublisherTally(name)
        self._replacements = Replacements(name, recorder=self._recorder, policy=lambda: self.policy,
                                          orchestrator=lambda: self.orchestrator, stopped=self._stop.is_set)
        self._snapshots = Snapshots(name, staging=self._staging, segments=self._planes.segments,
                                    slot_device=self._slot_device,
                                    pipeline=pipelined, committed=lambda v: self._sender.submit(PutCommitted(v)),
                                    tally=self._tally, spill_ahead=spill_ahead)
        self._sender = Sender(name, settings=self.settings, staging=self._staging, membership=self.membership,
                              recorder=self._recorder, policy=self.policy, control=self._control, table=self._table,
                              make_plane=self._planes.make_group_plane, slot_device=self._slot_device,
                              on_change=self._notify_members, on_evicted=self._replacements.member_dropped,
                              planes=self._planes.names, plane_objects=self._planes.objects,
                              buckets=self._planes.buckets,
                              tally=self._tally, encoding=encoding, digest=digest,
                              lane=(self.rank, self.world_size))
        self._staging.held, self._staging.overdue = self._sender.leases.held, self._sender.leases.overdue
        self._last_version: int | None = None
        self._put_lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        self._members_changed: asyncio.Event | None = None
        self._address: str | None = None
        self._trainers = None if self.world_size == 1 else TrainerRanks(
            name, self.rank, self.world_size, rank0=rank0, group=group, table=self._table,
            control=self._control, options=self.options, settings=self.settings, secret=self._secret,
            fingerprint=auth.fingerprint(self.backend, self.device), recorder=self._recorder, rec=self._rec,
            admit=self._door.admit, set_lanes=self._sender.set_lanes)
        self._door.sender, self._door.trainers = self._sender, self._trainers

    # lifecycle ----------------------------------------------------------------------------
    def _closing(self) -> bool:
        """Whether joins are refused: only once closing. A join that comes while start() is still
        running is admitted and waits for the sender thread; on a sharded publisher it can (rank 0
        hands out a rank's lane once that rank registered, before its start() returned)."""
        return self._state in (EndState.CLOSING, EndState.CLOSED)

    async def __aenter__(self) -> Publisher:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await (self.aclose() if exc[0] is None else self.abort())

    async def start(self) -> None:
        """Start serving the control connection and the sender thread."""
        if self._state is not EndState.NEW:
            raise Closed("a Publisher starts once", channel=self.name)
        self._loop = asyncio.get_running_loop()
        self._put_lock = asyncio.Lock()
        self._members_changed = asyncio.Event()
        self._replacements.bind(self._loop)
        executor = self._snapshots.open()
        host, listening = self._bind[0], False
        try:
            self._planes.open()
            try:
                port = await self._loop.run_in_executor(executor, self._control.start, self.options.timeout)
            except (OSError, ControlFailure) as err:
                raise WeightSyncError(f"could not listen on {host}:{self._bind[1]}: {err}",
                                      channel=self.name) from err
            listening, self._address = True, f"{advertised_host(host)}:{port}"
            self._recorder.configure(default_directory=f"{self.name}-{self._address.replace(':', '-')}")
            self._recorder.say_where()
            if self._secret is None and not is_loopback(host):
                warn_open_channel(self.name, self._address)
            if self._trainers is not None:
                await self._trainers.start(self._address)
        except BaseException:
            if listening:
                await self._loop.run_in_executor(None, self._control.stop, self.options.timeout)
            self._planes.close()
            executor.shutdown(wait=False)
            self._state = EndState.CLOSED
            raise
        self._state = EndState.RUNNING
        self._threads = lifecycle.launch(((self._sender.main, "sender"),), f"ws-{self.name}")

    async def aclose(self, timeout: float | None = None) -> None:
        """Send what is pending (bounded by its deadlines), tell subscribers, stop. Idempotent."""
        self._state, closing = lifecycle.begin_close(self._state)
        if not closing:
            return
        self._sender.submit(Drain())
        await self._close(timeout if timeout is not None else Deadlines.closing(self.options.timeout))

    async def abort(self) -> None:
        """Stop at once (also during an aclose): pending puts fail with Closed. Idempotent."""
        self._sender.submit(Abort())
        self._stop.set()
        self._state, closing = lifecycle.begin_close(self._state)
        if not closing:
            return
        await self._close(self.options.timeout)

    async def _close(self, timeout: float) -> None:
        assert self._loop is not None
        deadline = time.monotonic() + timeout
        at_once = self._stop.is_set()  # abort(): nobody is waited for
        await lifecycle.join(self._loop, self._threads, deadline)  # the sender drains (bounded)
        self._stop.set()
        self._sender.submit(Abort())
        await lifecycle.join(self._loop, self._threads, deadline)
        if self._trainers is not None:  # sharded puts: the other ranks' word on them, within the deadline
            await self._trainers.close(lambda: deadline - time.monotonic(), at_once)
        await self._loop.run_in_executor(None, self._control.stop, max(deadline - time.monotonic(), 1.0))
        self._table.close()  # a retired group still forming (a member died meanwhile) gives up now
        for job in self._staging.drain():
            job.handle.resolve_threadsafe(error=Closed("publisher closed before sending", channel=self.name,
                                                       version=job.version))
        self._staging.clear()  # the snapshots' memory goes now, not when this object is collected
        self._snapshots.close()
        self._planes.close()
        await self._replacements.finish(self.options.timeout)
        await lifecycle.finish_close(self._loop, self._snapshots.executor, self._recorder,
                                     Deadlines.teardown(self.options.timeout))
        self._state = EndState.CLOSED

    # public surface -----------------------------------------------------------------------
    @property
    def address(self) -> str:
        """``"host:port"`` of the control server, to hand to subscribers (known once started).

        Raises RuntimeError before ``start()`` (``async with``): the port is chosen then.
        """
        if self._address is None:
            raise RuntimeError("the publisher's address is known once it has started (async with Publisher(...))")
        return self._address

    @property
    def members(self) -> tuple[str, ...]:
        """Subscribers of the current generation, in rank order."""
        return tuple(self.membership.members)

    @property
    def generation(self) -> int:
        return self.membership.generation

    @property
    def version(self) -> int | None:
        """The newest version put (not necessarily delivered yet)."""
        return self._last_version

    def peak_snapshots(self) -> int:
        """The most staging buffers ever held at once: at most ``max_snapshots``, one more with
        deltas (the base) and up to two more while same-host members read versions in place."""
        return self._staging.peak_buffers

    async def wait_subscribers(self, n: int, timeout: float | None = None) -> tuple[str, ...]:
        """Wait until at least ``n`` subscribers are in the current generation."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        check_timeout("timeout", timeout)
        self._check_running()
        assert self._members_changed is not None
        limit = self.options.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while len(self.membership.members) < n:
            self._members_changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                raise SyncTimeout(f"{len(self.membership.members)} of {n} subscribers after {limit:.3g}s",
                                  channel=self.name)
            try:
                await asyncio.wait_for(self._members_changed.wait(), min(left, self.options.heartbeat_interval))
            except asyncio.TimeoutError:
                pass
            self._check_running()  # a sender that died ends the wait with Closed (from its error)
        return self.members

    @property
    def pipeline(self) -> bool:
        """Whether a host snapshot is sent while it is taken (may be changed between puts)."""
        return self._snapshots.pipeline

    @pipeline.setter
    def pipeline(self, on: bool) -> None:
        self._snapshots.pipeline = bool(on)

    @property
    def spill_ahead(self) -> bool:
        """Whether copy=False versions are spilled ahead (see the argument; may change between puts)."""
        return self._snapshots.spill_ahead

    @spill_ahead.setter
    def spill_ahead(self, on: bool) -> None:
        self._snapshots.spill_ahead = bool(on)

    @property
    def checksum(self) -> bool:
        """Per-bucket digests for the versions put from now on (may be changed at any time)."""
        return self._sender.checksum

    @checksum.setter
    def checksum(self, on: bool) -> None:
        self._sender.checksum = bool(on)

    @property
    def digest(self) -> str:
        """The per-bucket digest function every Announce names (``"crc32c"`` or ``"xxh3"``)."""
        return self._sender.digest

    @property
    def evicted(self) -> list[MemberInfo]:
        """Every member dropped so far, with ``.reason`` (dead, failed, slow, operator)."""
        return self._sender.evicted

    @property
    def replacements(self) -> list[asyncio.Future[None]]:
        """The orchestrator's replacements started so far, as futures of the caller's loop (each
        ``replace`` runs on the publisher's own replacement thread)."""
        return [asyncio.wrap_future(f) for f in self._replacements.futures]

    async def evict(self, member_id: str, reason: str = "operator") -> None:
        """Drop ``member_id`` at the next generation (it raises Evicted and may rejoin)."""
        self._check_running()
        if member_id not in self.membership.members:
            raise ValueError(f"{member_id!r} is not a member of {self.name!r} (members: {self.members})")
        self._sender.submit(Evict(member_id, reason))

    def statistics(self) -> PublisherStatistics:
        """A frozen snapshot of this publisher's counters, distributions and members (any time)."""
        return self._tally.snapshot(generation=self.membership.generation,
                                    members=self.membership.member_statistics(self._tally.newest_put,
                                                                              self._sender.transport_of))

    async def put(self, tensors: layout.TensorsLike, *, version: int | None = None, copy: bool = True,
                  owners: Mapping[str, int] | None = None, dtype: layout.CastLike = None,
                  encoding: str | None = None, quantize: str | None = None) -> PutHandle:
        """Queue a new version; returns once the snapshot is taken.

        With ``copy=True`` the tensors are copied into staging (on CUDA: a stream-ordered
        device copy, so the host does not wait) and may change as soon as this returns.
        With ``copy=False`` nothing is copied: keep the tensors unchanged until
        ``await handle.released()``. A pending put that a newer one replaces resolves with
        ``DeliveryReport.superseded``.

        On a sharded publisher (``world_size > 1``) every rank puts the same version with the
        same tensors (DTensors and plain ones): each sends only what it owns (see
        docs/sharding.md; ``owners`` names the rank that sends a plain tensor, default 0), only
        once every rank's put agreed; the handle resolves once every rank's part was delivered.

        ``dtype`` (a floating dtype, or a mapping of names to dtypes) sends the floating-point
        tensors in that dtype, as the engine serves them: the cast is done in the snapshot's copy
        (with ``copy=False``, bucket by bucket as each is sent), so the wire, the staging buffers
        and every member's slot hold the cast bytes. Integer and bool tensors keep their dtype.
        Cast to what the engine serves, a delta saves what it should: most bf16 elements keep
        their bits from one RL step to the next, where every fp32 one changes.

        ``encoding`` overrides the publisher's for this version (``"full"``, ``"delta"``,
        ``"auto"``; the delta ones need a publisher whose own encoding is not ``"full"``: only
        such a publisher keeps the base they are made against). A ``copy=False`` put has no
        snapshot to be the next base: the first one that asks for ``"delta"`` makes the publisher
        keep a copy of what it sends (one version's bytes), refreshed by every later copy=False
        put, until a put with a snapshot (docs/deltas.md, "``copy=False``").

        ``quantize`` (``"fp8-block"``, ``"int8-channel"``) sends the linear layers' weights as a
        checkpoint of that format holds them (the quantized weight and its scales under the
        format's names), quantized on their own device before the snapshot; ``dtype`` then casts
        the tensors kept as they were, and is what a quantized weight is cast to first. A weight
        holding NaN or infinity is refused here, naming it (docs/quantization.md). On a sharded
        publisher every rank quantizes its own shards with the whole weight's scales (one small
        all-reduce per mesh dimension over the weights' meshes: every rank must put).
        """
        began = time.perf_counter()
        if encoding is not None:
            if not known(encoding):
                raise ValueError(f"encoding {encoding!r} is neither built in nor registered")
            if encoding != FULL and self.encoding == FULL:
                raise ValueError(f"put(encoding={encoding!r}) on a publisher created with encoding='full', which "
                                 "keeps no base version to encode against: create it with encoding='auto'")
        handle = await self._put(tensors, version=version, copy=copy, owners=owners, dtype=dtype,
                                 encoding=encoding, quantize=quantize)
        self._tally.put_returned(handle.version, time.perf_counter() - began)
        return handle

    def _refuse_formats(self, quantize: str | None) -> None:
        """A format weightsync does not write, or one a member's engine does not load, is refused
        before anything is made (its engine would refuse it at the load, after the wire)."""
        fmt = "" if quantize is None else quantization.format_of(quantize).name
        assert self._control is not None
        other = {member: loads for member, loads in self._control.formats().items() if loads != fmt}
        if other:
            member, loads = sorted(other.items())[0]
            raise ValueError(f"put(quantize={fmt or None!r}): member {member!r} loads "
                             f"{repr(loads) + ' checkpoints' if loads else 'unquantized weights'}"
                             f"{f' (and {len(other) - 1} more members another format)' if len(other) > 1 else ''}: "
                             "nothing was sent (put it with the format the engines were started from)")

    async def _put(self, tensors: layout.TensorsLike, *, version: int | None = None, copy: bool = True,
                   owners: Mapping[str, int] | None = None, dtype: layout.CastLike = None,
                   encoding: str | None = None, quantize: str | None = None) -> PutHandle:
        """The body of :meth:`put` (its stall is timed around this)."""
        self._check_running()
        assert self._put_lock is not None and self._loop is not None
        items = layout.as_items(tensors, sharded=self.world_size > 1)
        self._refuse_formats(quantize)
        if quantize is not None:
            # off the event loop: a large version's quantization on the host takes seconds
            if self.world_size > 1:  # each rank its own shards, the scales agreed over the weights' meshes
                bound = Deadlines(self.settings).ranks_agreement()
                items, dtype = await self._loop.run_in_executor(
                    None, functools.partial(quantization.quantize_sharded_items, items, quantize, dtype, timeout=bound))
            else:
                items, dtype = await self._loop.run_in_executor(None, quantization.quantize_items, items, quantize,
                                                                dtype)
        if all(t.numel() == 0 for _, t in items):  # {} or only empty tensors: nothing a member could load
            raise ValueError(f"put() of {'no tensors' if not items else 'only empty tensors'}: a version "
                             "holds at least one element (an empty one would reach generators as every "
                             "parameter missing)")
        wire = layout.wire_dtypes(items, dtype)
        if owners and self.world_size == 1:
            raise ValueError("owners is for sharded publishers (world_size > 1)")
        async with self._put_lock:
            self._check_running()
            version = lifecycle.next_version(version, self._last_version)
            assembly: _wire.Assembly | None = None
            if self._trainers is not None:
                items, manifest, assembly = await self._trainers.agree(items, version, owners, wire)
            else:  # tied weights (one tensor under two names) are sent once
                items, manifest = layout.untied_manifest(items, wire)
            layout.check_encoded_size(manifest, assembly, MAX_FRAME // 2)
            handle = PutHandle(self.name, version, self._loop)
            entry = self._rec.record("put", version=version,
                                          nbytes=manifest.total_bytes).start()
            job = Job(version=version, manifest=manifest, handle=handle, assembly=assembly, encoding=encoding or "")
            await self._snapshots.take(job, items, copy=copy, entry=entry)
            self._last_version = version
            return handle if self._trainers is None else self._trainers.whole(handle)

    def _check_running(self) -> None:
        if self._state is not EndState.RUNNING or self._sender.state is SenderState.FAILED:
            raise Closed("publisher is not running", channel=self.name) from self._sender.fatal.error

    def _notify_members(self) -> None:
        if self._members_changed is not None:
            call_soon(self._loop, self._members_changed.set)

