"""The one owner of a sharded publisher's coordination with its other trainer ranks.

A publisher with ``world_size > 1`` is one rank of a sharded trainer (FSDP2 lanes, TP slices).
Everything it does with the other ranks lives here, on the publisher's event loop and the worker
threads it borrows: meeting them at start (rank 0 hosts the meeting point, every other rank
connects to it and registers its lane), holding subscribers' joins on rank 0 until every lane is
known, agreeing on each put before anything is sent, settling each put's handle once every rank
said what became of its part, and closing (the other ranks' word on pending puts, within the
close's deadline). The wire protocol of those steps is :mod:`weightsync.membership.ranks`.

Threads: none of its own. Rank 0's control thread calls :meth:`TrainerRanks.on_rank_link`,
:meth:`TrainerRanks.hold` and :meth:`TrainerRanks.lost`; the rest runs on the event loop, with
blocking store calls in the loop's default executor.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from weightsync import _wire
from weightsync._wire import ChannelSettings
from weightsync.control import auth
from weightsync.control.rendezvous import KeyValue
from weightsync.control.server import ControlServer, Link
from weightsync.engine.handles import DeliveryReport, PutHandle
from weightsync.errors import Closed, WeightSyncError
from weightsync.format import sharding
from weightsync.membership import ranks
from weightsync.options import ChannelOptions, Deadlines, parse_address
from weightsync.recorder.recorder import FlightRecorder, RecorderScope


class TrainerRanks:
    """One rank's side of a sharded publisher's coordination (see the module docstring).

    Args:
        channel, rank, world: the channel and this rank's place among ``world`` trainer ranks.
        rank0: where rank 0 listens (ranks > 0 that were given its address; None to learn it
            through ``group`` at start).
        group: a torch.distributed group over the trainer ranks, used once to share rank 0's
            address (None when ranks > 0 were given it).
        table, control: rank 0's rendezvous table and control server (the meeting point).
        admit: called with a subscriber's join once it may be admitted (rank 0).
        set_lanes: called with ranks 1..W-1's lane addresses once all registered (rank 0).
    """

    def __init__(self, channel: str, rank: int, world: int, *, rank0: tuple[str, int] | None, group: Any,
                 table: KeyValue, control: ControlServer, options: ChannelOptions, settings: ChannelSettings,
                 secret: bytes | None, fingerprint: auth.Fingerprint, recorder: FlightRecorder, rec: RecorderScope,
                 admit: Callable[[Link], None], set_lanes: Callable[[tuple[str, ...]], None]) -> None:
        self.channel, self.rank, self.world = channel, rank, world
        self._rank0, self._group = rank0, group
        self._table, self._control = table, control
        self._options, self._settings, self._deadlines = options, settings, Deadlines(settings)
        self._secret, self._fingerprint = secret, fingerprint
        self._recorder, self._rec = recorder, rec
        self._admit, self._set_lanes = admit, set_lanes
        self._hub = ranks.Hub(channel, world, table, rec) if rank == 0 else None
        self._link: ranks.Link | None = None
        self._ranks: ranks.Ranks | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._join_lock = threading.Lock()
        self._held: list[Link] = []  # rank 0: subscribers that joined before every rank registered
        self._lanes_known = False
        self._lanes_task: asyncio.Task[None] | None = None
        self._error: WeightSyncError | None = None
        self._settling: set[asyncio.Task[None]] = set()  # puts waiting for the other ranks' word

    # control thread (rank 0) ---------------------------------------------------------------------
    def on_rank_link(self, link: Link) -> None:
        """Another trainer rank's connection passed the door: admitted here, never a member."""
        assert self._hub is not None
        rank = self._hub.accept(link.member_id, link.incarnation)
        self._control.bind(link.incarnation)
        if rank is None:
            self._control.send(link.incarnation, _wire.Deny(reason="not a rank of this publisher", kind="token"))
            self._control.release(link.member_id, "refused")
        else:
            self._control.send(link.incarnation, _wire.Admit(member_id=link.member_id, generation=-1,
                                                             members=(), settings=self._settings))

    def hold(self, link: Link) -> bool:
        """True when a subscriber's join waits here until every rank's lane is known (rank 0)."""
        with self._join_lock:
            if self._hub is not None and not self._lanes_known:
                self._held.append(link)
                return True
        return False

    def rank_left(self, member_id: str) -> None:
        assert self._hub is not None
        self._hub.lost(member_id, "left")
        self._control.release(member_id, "left")

    def lost(self, member_id: str, reason: str) -> bool:
        """True when ``member_id`` was a trainer rank (its waits end now); False for a subscriber."""
        if self._hub is None or ranks.rank_of(member_id, self.world) is None:
            return False
        self._hub.lost(member_id, reason)
        self._recorder.dump_on_trouble(f"trainer {member_id}: {reason}")
        return True

    # event loop ----------------------------------------------------------------------------------
    async def start(self, address: str) -> None:
        """Every rank > 0 connects to rank 0 and registers its lane address. Rank 0 does not wait
        for them here (its address may be what they need); it holds subscribers' joins until all
        registered, so every subscriber it admits learns every lane (Admit.lanes)."""
        self._loop = loop = asyncio.get_running_loop()
        limit = self._deadlines.ranks_meeting()
        try:
            if self._group is not None:
                self._rank0 = parse_address(await loop.run_in_executor(
                    None, ranks.share_address, self._group, address if self.rank == 0 else ""))
            if self._hub is not None:
                self._ranks = ranks.Ranks(self.channel, 0, self.world, self._hub.store(limit), self._rec, limit)
                self._lanes_task = loop.create_task(self._await_lanes())
                return
            assert self._rank0 is not None
            self._link = ranks.Link(self.channel, self.rank, host=self._rank0[0], port=self._rank0[1],
                                    secret=self._secret, fingerprint=self._fingerprint, rec=self._rec,
                                    timeout=self._options.timeout)
            await loop.run_in_executor(None, self._link.connect, limit)
            self._ranks = ranks.Ranks(self.channel, self.rank, self.world, self._link.store(limit), self._rec, limit)
            await loop.run_in_executor(None, self._ranks.register, address)
        except BaseException:
            if self._link is not None:
                self._link.close()
            raise

    async def _await_lanes(self) -> None:
        """Rank 0: once every rank registered, admit the subscribers held meanwhile."""
        assert self._loop is not None and self._ranks is not None
        try:
            lanes = await self._loop.run_in_executor(None, self._ranks.lanes, self._deadlines.ranks_start())
        except WeightSyncError as err:
            self._rec.record("rank").fail(err)
            self._recorder.dump_on_trouble(f"trainer ranks did not start: {err}")
            self._error = err  # puts raise it; held subscribers time out on their own deadline
            return
        self._rec.record("rank", peers=lanes).complete()
        self._set_lanes(lanes)
        with self._join_lock:
            held, self._held, self._lanes_known = self._held, [], True
        for link in held:
            self._admit(link)

    async def agree(self, items: list[tuple[str, Any]], version: int, owners: Mapping[str, int] | None,
                    wire: Mapping[str, torch.dtype] | None = None
                    ) -> tuple[list[tuple[str, torch.Tensor]], _wire.Manifest, _wire.Assembly]:
        """This rank's pieces of a sharded put, once every rank agreed on it (before anything is sent);
        ``wire``: the tensors ``put(dtype=)`` casts (every rank must cast the same: the digest says)."""
        assert self._loop is not None and self._ranks is not None
        if self._error is not None:
            raise self._error
        part = sharding.split(items, self.rank, self.world, owners, wire)
        payload = sum(spec.nbytes for spec in part.manifest.tensors)
        await self._loop.run_in_executor(None, self._ranks.agree, version, sharding.digest(version, part.manifest),
                                         part.owned_bytes, payload, self._deadlines.ranks_agreement())
        return part.items, part.lane, _wire.Assembly(self.rank, self.world, part.manifest, part.pieces)

    def whole(self, handle: PutHandle) -> PutHandle:
        """A handle that resolves once every rank's part of ``handle``'s version was delivered."""
        assert self._loop is not None
        outer = PutHandle(self.channel, handle.version, self._loop)
        outer._spill = handle._spill  # released(spill=True) on the whole: this rank's own part  # noqa: SLF001
        task = self._loop.create_task(self._settle_whole(handle, outer))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
        return outer

    async def _settle_whole(self, own: PutHandle, outer: PutHandle) -> None:
        assert self._loop is not None
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
                                                  channel=self.channel, version=version))
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
            limit = self._deadlines.ranks_outcome(report.nbytes if report else 0, self.world)
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
                channel=self.channel, version=version))
        elif report is None or any(w == "superseded" for w in words.values()):
            outer.resolve_threadsafe(DeliveryReport(version=version, members=(), nbytes=0, seconds=0.0,
                                                    superseded=True))
        else:
            outer.resolve_threadsafe(report)

    async def close(self, left: Callable[[], float], at_once: bool) -> None:
        """Pending puts get the other ranks' word (within ``left()`` seconds, unless ``at_once``),
        then everything here stops; rank 0 waits for the other ranks to go (they may still read
        the table for their outcomes)."""
        loop = asyncio.get_running_loop()
        if self._settling:
            if not at_once:
                await asyncio.wait(set(self._settling), timeout=max(left(), 0.1))
            for task in set(self._settling):
                task.cancel()
        if self._lanes_task is not None:
            self._lanes_task.cancel()
        if self._link is not None:
            await loop.run_in_executor(None, self._link.close)
        if self._hub is not None and not at_once:
            await loop.run_in_executor(None, self._hub.wait_gone, max(left(), 0.0))
