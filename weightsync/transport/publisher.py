"""Publisher: the trainer's end of a channel.

Who calls what, in order:

1. the trainer enters ``async with Publisher(name, address=...)``: two components start their
   threads: the :class:`~weightsync.control.server.ControlServer` (every member's authenticated
   connection: admission, beats, replies, the data plane's rendezvous) and the
   :class:`~weightsync.transport.sender.Sender` (generations, announce, data plane,
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
import contextlib
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from weightsync import _wire
from weightsync._errors import ControlFailure
from weightsync.control import auth
from weightsync.control.framing import MAX_FRAME
from weightsync.control.rendezvous import KeyValue, LocalStore
from weightsync.control.server import ControlServer, Link
from weightsync.errors import Closed, SyncTimeout, WeightSyncError
from weightsync.orchestrator import Orchestrator, Replacements
from weightsync.pg.group import GroupPlane, reconfigure_enabled, resolve_backend
from weightsync.pg.membership import MemberInfo, Membership, StragglerPolicy
from weightsync.pg.recorder import FlightRecorder, process_recorder
from weightsync.statistics import MemberStatistics, PublisherStatistics, PublisherTally
from weightsync.transport import layout, lifecycle, ranks, sharding, shm
from weightsync.transport.handles import DeliveryReport, PutHandle, check_timeout
from weightsync.transport.lifecycle import EndState, call_soon
from weightsync.transport.options import (
    ChannelOptions,
    Deadlines,
    MiB,
    advertised_host,
    is_loopback,
    parse_address,
    resolve_device,
    warn_open_channel,
)
from weightsync.transport.sender import Abort, Drain, Evict, Join, Leave, MemberDied, PutCommitted, Sender, SenderState
from weightsync.transport.staging import (
    Job,
    Progress,
    Staging,
    cuda_snapshot,
    pack_progressively,
    superseded_report,
)

RANKS_START = 120.0  # seconds rank 0 waits, at least, for the other trainer ranks to register
PIPELINE_CPUS = 4  # usable CPUs from which a host snapshot is sent while it is taken


def _usable_cpus() -> int:
    """CPUs this process may run on (its affinity where the OS has one, else all of them)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


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
        pipeline: send a host snapshot while it is being taken (bucket i leaves once its bytes
            are copied; ``put`` still returns after the whole snapshot). Default: on where this
            process may use at least 4 CPUs. With fewer, the copies of the send and of same-host
            members compete with the snapshot for the cores and ``put`` itself gets slower
            (measured on 2 cores: docs/benchmarks.md), so the snapshot completes first.
        rank, world_size: a sharded trainer (docs/sharding.md): one Publisher on every trainer
            rank, each sending only the bytes it owns over its own group. Rank 0 listens at
            ``address``; on the other ranks ``address`` is rank 0's (a fixed port, or its
            ``pub.address``), and each listens for its own subscribers' data at ``lane_address``
            (default: port 0 on the interface named by ``address``). ``world_size=1`` (the
            default) is the single-process publisher.
        group: instead of rank and world_size: a ProcessGroup of the trainer ranks; rank 0's
            address travels to the others over it (a tensor broadcast, no pickle).
    """

    def __init__(self, name: str, *, address: str | None = None, backend: str = "auto",
                 device: str | torch.device | None = None, bucket_bytes: int = 64 * MiB, timeout: float = 30.0,
                 min_bandwidth: float = 50e6, heartbeat_interval: float = 1.0, secret: str | bytes | None = None,
                 max_snapshots: int = 2, recorder: FlightRecorder | None = None,
                 flight_recorder_dir: str | os.PathLike[str] | None = None, policy: StragglerPolicy | None = None,
                 orchestrator: Orchestrator | None = None, checksum: bool = True,
                 pipeline: bool | None = None, rank: int | None = None, world_size: int | None = None,
                 group: Any = None, lane_address: str | None = None) -> None:
        lifecycle.validate_name("channel name", name)
        self.rank, self.world_size = ranks.rank_and_world(rank, world_size, group)
        self._group = group
        if orchestrator is not None and not callable(getattr(orchestrator, "replace", None)):
            raise TypeError("orchestrator must have an async replace(member) method (see weightsync.Orchestrator)")
        self.name = name
        self.options = ChannelOptions(timeout=timeout, min_bandwidth=min_bandwidth, bucket_bytes=bucket_bytes,
                                      heartbeat_interval=heartbeat_interval)
        self._bind = parse_address(address or "127.0.0.1:0")
        self._rank0: tuple[str, int] | None = None  # where rank 0 listens (ranks > 0)
        if self.rank > 0:
            if self._bind[1] == 0 and group is None:
                raise ValueError(f"rank {self.rank}: address must be rank 0's 'host:port' (its pub.address), "
                                 "or pass group= to learn it from rank 0")
            self._rank0 = self._bind
            self._bind = parse_address(lane_address or f"{ranks.lane_host(self._bind[0])}:0")
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
        self.settings = self.options.settings(checksum=checksum, in_place=reconfigure_enabled(self.backend))
        self.pipeline = pipeline if pipeline is not None else _usable_cpus() >= PIPELINE_CPUS
        deadlines = Deadlines(self.settings)
        # on a CPU publisher staging lives in shared memory: same-host members copy from it
        self._segments = shm.SegmentPool(name) if self._slot_device.type == "cpu" and shm.available() else None
        self._staging = (Staging(max_snapshots, allocate=self._segments.allocate, drop=self._segments.drop,
                                 reuse=self._segments.reuse)
                         if self._segments is not None else Staging(max_snapshots))
        self._state = EndState.NEW
        self._stop = threading.Event()  # everything stops (after the sender drained, or at once)
        self._table = KeyValue()
        self._control = ControlServer(
            name, host=self._bind[0], port=self._bind[1], secret=self._secret,
            mine=auth.fingerprint(self.backend, self.device), table=self._table, recorder=self._rec,
            heartbeat_interval=self.options.heartbeat_interval, dead_after=deadlines.member_silence(),
            handshake_timeout=self.options.timeout, closing=lambda: self._state is not EndState.RUNNING,
            on_join=self._on_join, on_leave=self._on_leave,
            on_dead=self._on_dead, shm_offer=self._segments.offer if self._segments is not None else lambda: None,
            rank_links=self.world_size > 1 and self.rank == 0, wait_bound=2 * deadlines.rendezvous())
        self._hub = ranks.Hub(name, self.world_size, self._table, self._rec) if self._rank_links else None
        self._link: ranks.Link | None = None
        self._ranks: ranks.Ranks | None = None
        self.membership = Membership(name, self._recorder, self.options.heartbeat_interval,
                                     dead_after=deadlines.member_silence(), heard=self._control.heard,
                                     stale=self._control.stale)
        self._tally = PublisherTally(name)
        self._replacements = Replacements(name, recorder=self._recorder, policy=lambda: self.policy,
                                          orchestrator=lambda: self.orchestrator, stopped=self._stop.is_set)
        self._sender = Sender(name, settings=self.settings, staging=self._staging, membership=self.membership,
                              recorder=self._recorder, policy=self.policy, control=self._control, table=self._table,
                              make_plane=self._make_plane, slot_device=self._slot_device,
                              on_change=self._notify_members, on_evicted=self._replacements.member_dropped,
                              segments=self._segments, tally=self._tally)
        self._last_version: int | None = None
        self._put_lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._threads: list[threading.Thread] = []
        self._members_changed: asyncio.Event | None = None
        self._copy_stream: Any = None
        self._address: str | None = None
        self._settling: set[asyncio.Task[None]] = set()  # sharded puts waiting for the other ranks' word
        self._join_lock = threading.Lock()
        self._held: list[Link] = []  # rank 0: subscribers that joined before every rank registered
        self._lanes_known = False
        self._lanes_task: asyncio.Task[None] | None = None
        self._ranks_error: WeightSyncError | None = None

    def _make_plane(self) -> GroupPlane:
        """The sender thread's data plane (rank 0 of every generation), on the in-memory rendezvous."""
        timeout = Deadlines(self.settings).rendezvous()
        return GroupPlane(LocalStore(self._table, timeout), channel=self.name, member="publisher",
                          backend=self.backend, device=self._slot_device, recorder=self._recorder,
                          in_place=self.settings.in_place, slot=0, timeout=timeout, host=self._gloo_host())

    def _gloo_host(self) -> str | None:
        """gloo binds the address the control server listens on (None: every interface, gloo's pick)."""
        host = self._bind[0]
        return None if host in ("0.0.0.0", "::", "") else host

    @property
    def _rank_links(self) -> bool:
        return self.world_size > 1 and self.rank == 0

    def _on_join(self, link: Link) -> None:
        """Control thread: a connection passed the door; the Sender decides the rest."""
        if link.transport == "rank":  # another trainer rank: admitted here, never a member
            assert self._hub is not None
            rank = self._hub.accept(link.member_id, link.incarnation)
            self._control.bind(link.incarnation)
            if rank is None:
                self._control.send(link.incarnation, _wire.Deny(reason="not a rank of this publisher", kind="token"))
                self._control.release(link.member_id, "refused")
            else:
                self._control.send(link.incarnation, _wire.Admit(member_id=link.member_id, generation=-1,
                                                                 members=(), settings=self.settings))
            return
        with self._join_lock:
            if self._hub is not None and not self._lanes_known:  # admitted once every rank's lane is known
                self._held.append(link)
                return
        self._sender.submit(Join(link.member_id, link.incarnation, host=link.host, pid=link.pid,
                                 transport=link.transport, want=link.want))

    def _on_leave(self, link: Link) -> None:
        if link.transport == "rank":
            assert self._hub is not None
            self._hub.lost(link.member_id, "left")
            self._control.release(link.member_id, "left")
            return
        self._sender.submit(Leave(link.member_id))

    def _on_dead(self, member_id: str, reason: str) -> None:
        """Control thread: a member's connection closed, or it fell silent."""
        if self._hub is not None and ranks.rank_of(member_id, self.world_size) is not None:
            self._hub.lost(member_id, reason)  # a trainer rank: every wait for it ends now
            self._recorder.dump_on_trouble(f"trainer {member_id}: {reason}")
            return
        self._rec.record("heartbeat", peers=(member_id,)).fail(reason)
        self._recorder.dump_on_trouble(f"{member_id}: {reason}")
        self._sender.submit(MemberDied((member_id,)))

    # lifecycle ----------------------------------------------------------------------------
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
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"ws-{self.name}-snapshot")
        host = self._bind[0]
        try:
            if self._segments is not None:
                self._segments.open()
            port = await self._loop.run_in_executor(
                self._executor, self._control.start, self.options.timeout)
        except (OSError, ControlFailure) as err:
            if self._segments is not None:
                self._segments.close()
            self._executor.shutdown(wait=False)
            self._state = EndState.CLOSED
            raise WeightSyncError(f"could not listen on {host}:{self._bind[1]}: {err}", channel=self.name) from err
        self._address = f"{advertised_host(host)}:{port}"
        self._recorder.configure(default_directory=f"{self.name}-{self._address.replace(':', '-')}")
        if self._secret is None and not is_loopback(host):
            warn_open_channel(self.name, self._address)
        if self.world_size > 1:
            try:
                await self._meet_ranks()
            except BaseException:
                await self._loop.run_in_executor(None, self._control.stop, self.options.timeout)
                if self._link is not None:
                    self._link.close()
                if self._segments is not None:
                    self._segments.close()
                self._executor.shutdown(wait=False)
                self._state = EndState.CLOSED
                raise
        self._state = EndState.RUNNING
        self._threads = lifecycle.launch(((self._sender.main, "sender"),), f"ws-{self.name}")

    async def _meet_ranks(self) -> None:
        """Every rank > 0 connects to rank 0 and registers its lane address. Rank 0 does not wait
        for them here (its address may be what they need); it holds subscribers' joins until all
        registered, so every subscriber it admits learns every lane (Admit.lanes)."""
        assert self._loop is not None and self._address is not None
        limit = self.options.timeout * 2
        if self._group is not None:
            self._rank0 = parse_address(await self._loop.run_in_executor(
                None, ranks.share_address, self._group, self._address if self.rank == 0 else ""))
        if self._hub is not None:
            self._ranks = ranks.Ranks(self.name, 0, self.world_size, self._hub.store(limit), self._rec, limit)
            self._lanes_task = self._loop.create_task(self._await_lanes())
            return
        assert self._rank0 is not None
        self._link = ranks.Link(self.name, self.rank, host=self._rank0[0], port=self._rank0[1], secret=self._secret,
                                fingerprint=auth.fingerprint(self.backend, self.device), rec=self._rec,
                                timeout=self.options.timeout)
        await self._loop.run_in_executor(None, self._link.connect, limit)
        self._ranks = ranks.Ranks(self.name, self.rank, self.world_size, self._link.store(limit), self._rec, limit)
        await self._loop.run_in_executor(None, self._ranks.register, self._address)

    async def _await_lanes(self) -> None:
        """Rank 0: once every rank registered, admit the subscribers held meanwhile."""
        assert self._loop is not None and self._ranks is not None
        try:
            limit = max(RANKS_START, self.options.timeout * 4)
            lanes = await self._loop.run_in_executor(None, self._ranks.lanes, limit)
        except WeightSyncError as err:
            self._rec.record("rank").fail(err)
            self._recorder.dump_on_trouble(f"trainer ranks did not start: {err}")
            self._ranks_error = err  # puts raise it; held subscribers time out on their own deadline
            return
        self._rec.record("rank", peers=lanes).complete()
        self._sender.set_lanes(lanes)
        with self._join_lock:
            held, self._held, self._lanes_known = self._held, [], True
        for link in held:
            self._on_join(link)

    async def aclose(self, timeout: float | None = None) -> None:
        """Send what is pending (bounded by its deadlines), tell subscribers, stop. Idempotent."""
        self._state, closing = lifecycle.begin_close(self._state)
        if not closing:
            return
        self._sender.submit(Drain())
        await self._close(timeout if timeout is not None else self.options.timeout * 4)

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
        if self._settling:  # sharded puts: the other ranks' word on them, within the close's deadline
            if not at_once:
                await asyncio.wait(set(self._settling), timeout=max(deadline - time.monotonic(), 0.1))
            for task in set(self._settling):
                task.cancel()
        if self._lanes_task is not None:
            self._lanes_task.cancel()
        if self._link is not None:
            await self._loop.run_in_executor(None, self._link.close)
        if self._hub is not None and not at_once:  # the other ranks may still read the table (their outcomes)
            await self._loop.run_in_executor(None, self._hub.wait_gone, max(deadline - time.monotonic(), 0.0))
        await self._loop.run_in_executor(None, self._control.stop, max(deadline - time.monotonic(), 1.0))
        self._table.close()  # a retired group still forming (a member died meanwhile) gives up now
        for job in self._staging.drain():
            job.handle.resolve_threadsafe(error=Closed("publisher closed before sending", channel=self.name,
                                                       version=job.version))
        self._staging.clear()  # the snapshots' memory goes now, not when this object is collected
        if self._segments is not None:  # members that still map a segment keep it until they unmap
            self._segments.close()
        await self._replacements.finish(self.options.timeout)
        await lifecycle.finish_close(self._loop, self._executor, self._recorder, self.options.timeout * 3)
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
        """The most staging buffers ever held at once (never above ``max_snapshots``)."""
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
    def checksum(self) -> bool:
        """Per-bucket digests for the versions put from now on (may be changed at any time)."""
        return self._sender.checksum

    @checksum.setter
    def checksum(self, on: bool) -> None:
        self._sender.checksum = bool(on)

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
        newest = self._tally.newest_put
        members = [MemberStatistics(member_id=m, transport=self._sender.transport_of(m), last_version=v,
                                    lag=None if v is None or newest is None else max(newest - v, 0),
                                    last_receive_seconds=s)
                   for m, (v, s) in self.membership.last_versions().items()]
        return self._tally.snapshot(generation=self.membership.generation, members=members)

    async def put(self, tensors: layout.TensorsLike, *, version: int | None = None, copy: bool = True,
                  owners: Mapping[str, int] | None = None) -> PutHandle:
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
        """
        began = time.perf_counter()
        handle = await self._put(tensors, version=version, copy=copy, owners=owners)
        self._tally.put_returned(handle.version, time.perf_counter() - began)
        return handle

    async def _put(self, tensors: layout.TensorsLike, *, version: int | None = None, copy: bool = True,
                   owners: Mapping[str, int] | None = None) -> PutHandle:
        """The body of :meth:`put` (its stall is timed around this)."""
        self._check_running()
        assert self._put_lock is not None and self._loop is not None
        items = layout.as_items(tensors, sharded=self.world_size > 1)
        if owners and self.world_size == 1:
            raise ValueError("owners is for sharded publishers (world_size > 1)")
        async with self._put_lock:
            self._check_running()
            if version is None:
                version = 0 if self._last_version is None else self._last_version + 1
            if not isinstance(version, int) or isinstance(version, bool):
                raise TypeError(f"version must be an int, got {type(version).__name__}")
            if not 0 <= version < 1 << 63:
                raise ValueError(f"version must be in [0, 2**63), got {version}")
            if self._last_version is not None and version <= self._last_version:
                raise ValueError(f"versions must strictly increase: {version} after {self._last_version}")
            assembly: _wire.Assembly | None = None
            if self.world_size > 1:
                items, manifest, assembly = await self._agree(items, version, owners)
            else:  # tied weights (one tensor under two names) are sent once
                items, ties = layout.untie(items)
                manifest = layout.build_manifest(items, ties)
            if len(_wire.encode(manifest)) + len(_wire.encode(assembly)) > MAX_FRAME // 2:
                raise ValueError(f"the manifest of {len(items)} tensors is over {MAX_FRAME // 2} bytes encoded: "
                                 "shorter names, or fewer tensors per channel")
            handle = PutHandle(self.name, version, self._loop)
            entry = self._rec.record("put", version=version,
                                          nbytes=manifest.total_bytes).start()
            job = Job(version=version, manifest=manifest, handle=handle, assembly=assembly)
            displaced: Job | None = None
            if copy:
                pin = self._slot_device.type == "cpu" and torch.cuda.is_available()
                buf, displaced = self._staging.acquire(manifest.total_bytes, self._slot_device, pin=pin)
                if self.pipeline and not any(t.is_cuda for _, t in items):
                    return await self._put_pipelined(job, buf, displaced, items, entry)
                try:
                    job.flat, job.ready = await self._snapshot(buf, manifest, items)
                except BaseException as err:
                    self._staging.give_back(buf)
                    self._fail_displaced(displaced, version, err)
                    raise
            else:
                job.items = items
            displaced = self._staging.commit(job) or displaced
            self._sender.submit(PutCommitted(version))
            self._last_version = version
            entry.complete()
            if displaced is not None:
                self._tally.count("versions_superseded")
                displaced.handle.resolve_threadsafe(superseded_report(displaced))
            return self._whole(handle)

    async def _agree(self, items: list[tuple[str, Any]], version: int, owners: Mapping[str, int] | None
                     ) -> tuple[list[tuple[str, torch.Tensor]], _wire.Manifest, _wire.Assembly]:
        """This rank's pieces of a sharded put, once every rank agreed on it (before anything is sent)."""
        assert self._loop is not None and self._ranks is not None
        if self._ranks_error is not None:
            raise self._ranks_error
        part = sharding.split(items, self.rank, self.world_size, owners)
        payload = sum(spec.nbytes for spec in part.manifest.tensors)
        await self._loop.run_in_executor(None, self._ranks.agree, version, sharding.digest(version, part.manifest),
                                         part.owned_bytes, payload, self.options.timeout * 2)
        return part.items, part.lane, _wire.Assembly(self.rank, self.world_size, part.manifest, part.pieces)

    def _whole(self, handle: PutHandle) -> PutHandle:
        """A sharded put's handle resolves once every rank's part of the version was delivered."""
        if self.world_size == 1:
            return handle
        assert self._loop is not None
        outer = PutHandle(self.name, handle.version, self._loop)
        task = self._loop.create_task(self._settle_whole(handle, outer))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
        return outer

    async def _settle_whole(self, own: PutHandle, outer: PutHandle) -> None:
        assert self._loop is not None and self._ranks is not None
        version = own.version

        async def released() -> None:
            with contextlib.suppress(WeightSyncError):
                await own.released()
            outer.release_threadsafe()

        forward = self._loop.create_task(released())
        try:
            await self._settle_own(own, outer, forward)
        except asyncio.CancelledError:  # the publisher closed first: every handle still resolves
            forward.cancel()
            outer.resolve_threadsafe(error=Closed("publisher closed before every rank's part was delivered",
                                                  channel=self.name, version=version))
            raise

    async def _settle_own(self, own: PutHandle, outer: PutHandle, forward: asyncio.Task[None]) -> None:
        assert self._loop is not None and self._ranks is not None
        version = own.version
        report: DeliveryReport | None = None
        try:
            report = await own
            status = "superseded" if report.superseded else "ok"
        except WeightSyncError as err:
            status = f"{type(err).__name__}: {err}"
        try:
            await forward
            await self._loop.run_in_executor(None, self._ranks.delivered, version, status)
            limit = self.options.timeout * 4 + (report.nbytes if report else 0) * self.world_size \
                / self.options.min_bandwidth
            words = await self._loop.run_in_executor(None, self._ranks.outcome, version, limit)
        except WeightSyncError as err:
            outer.resolve_threadsafe(error=err)
            return
        failed = {r: w for r, w in words.items() if w not in ("ok", "superseded")}
        if failed:
            self._rec.record("rank", version=version,
                             peers=tuple(ranks.rank_member(r) for r in failed)).fail("parts not delivered")
            outer.resolve_threadsafe(error=WeightSyncError(
                f"version {version}: trainer ranks {sorted(failed)} did not deliver their parts "
                f"({'; '.join(f'rank {r}: {w}' for r, w in sorted(failed.items()))[:400]})",
                channel=self.name, version=version))
        elif report is None or any(w == "superseded" for w in words.values()):
            outer.resolve_threadsafe(DeliveryReport(version=version, members=(), nbytes=0, seconds=0.0,
                                                    superseded=True))
        else:
            outer.resolve_threadsafe(report)

    async def _put_pipelined(self, job: Job, buf: torch.Tensor, displaced: Job | None,
                             items: list[tuple[str, torch.Tensor]], entry: Any) -> PutHandle:
        """A host snapshot, sent while it is taken: the version is committed first, and bucket i
        goes out (to the group, or to same-host members through the segment header) as soon as
        its bytes are copied. Returns, as every put, once the whole snapshot is taken."""
        assert self._loop is not None
        flat = buf[: job.manifest.total_bytes]
        mark = self._segments.marker(flat) if self._segments is not None else (lambda _n: None)
        job.flat, job.progress = flat, Progress(job.manifest.total_bytes, mark)
        displaced = self._staging.commit(job) or displaced
        self._sender.submit(PutCommitted(job.version))
        try:
            await self._loop.run_in_executor(self._executor, pack_progressively, flat, job.manifest, items,
                                             job.progress)
        except BaseException as err:
            # the sender gives the version up when its wait fails: the handle fails from there
            job.progress.fail(err)
            entry.fail(err)
            self._fail_displaced(displaced, job.version, err)
            raise
        self._last_version = job.version
        entry.complete()
        if displaced is not None:
            self._tally.count("versions_superseded")
            displaced.handle.resolve_threadsafe(superseded_report(displaced))
        return self._whole(job.handle)

    def _fail_displaced(self, displaced: Job | None, version: int, err: BaseException) -> None:
        if displaced is not None:  # its buffer may be half overwritten: it cannot go out
            displaced.handle.resolve_threadsafe(error=WeightSyncError(
                f"version {displaced.version} was displaced by version {version}, whose snapshot "
                f"failed: {err}", channel=self.name, version=displaced.version))

    async def _snapshot(self, buf: torch.Tensor, manifest: _wire.Manifest,
                        items: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, Any]:
        flat = buf[: manifest.total_bytes]
        if any(t.is_cuda for _, t in items):
            device = next(t.device for _, t in items if t.is_cuda)
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(device)
            return flat, cuda_snapshot(flat, manifest, items, self._copy_stream)
        assert self._loop is not None
        await self._loop.run_in_executor(self._executor, layout.pack_into, flat, manifest, items)
        return flat, None

    def _check_running(self) -> None:
        if self._state is not EndState.RUNNING or self._sender.state is SenderState.FAILED:
            raise Closed("publisher is not running", channel=self.name) from self._sender.fatal.error

    def _notify_members(self) -> None:
        if self._members_changed is not None:
            call_soon(self._loop, self._members_changed.set)

