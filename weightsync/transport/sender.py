"""The publisher's sender thread: announce, broadcast, checksums, acknowledgements; and what
it does about members: scoring slow ones and asking the orchestrator to replace dropped ones.

Runs on its own thread with its own store connection. In order, per version:

1. ``_sender_loop`` waits for a pending put or a membership change (a generation change comes
   first: ``Generations.advance``; a newcomer then gets the newest snapshot);
2. ``_send_once`` announces the version, broadcasts its buckets (checksumming each while the
   next is on the wire), sends the ``Seal`` and collects acknowledgements; on a failure the
   generation is rebuilt without the culprits and the version re-sent (``_send``);
3. ``_score`` feeds each member's own receive time to the straggler policy;
4. ``_finish`` resolves the PutHandle with a DeliveryReport.

:class:`~weightsync.transport.publisher.Publisher` inherits it; the state it shares is declared
below.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import torch

from weightsync import _wire
from weightsync.errors import WeightSyncError
from weightsync.orchestrator import Orchestrator
from weightsync.pg.control import ControlPlane
from weightsync.pg.generations import DATA_ERRORS, Generations, MemberInfo
from weightsync.pg.membership import Membership, StragglerPolicy
from weightsync.pg.recorder import FlightRecorder
from weightsync.transport import layout
from weightsync.transport.handles import DeliveryReport, call_soon
from weightsync.transport.options import ChannelOptions
from weightsync.transport.staging import BucketBuffers, Job, Staging, bucket_slices

log = logging.getLogger("weightsync")


class SenderLoop:
    """The sender thread's half of :class:`~weightsync.transport.publisher.Publisher`."""

    name: str
    options: ChannelOptions
    membership: Membership
    policy: StragglerPolicy
    orchestrator: Orchestrator | None
    checksum: bool
    evicted: list[MemberInfo]
    replacements: list[asyncio.Task[None]]
    _member: str
    _state: str
    _fatal: WeightSyncError | None
    _recorder: FlightRecorder
    _staging: Staging
    _gens: Generations
    _stop: threading.Event
    _draining: bool
    _slot_device: torch.device
    _bucket_buffers: BucketBuffers
    _loop: asyncio.AbstractEventLoop | None

    # the sender thread --------------------------------------------------------------------------
    def _sender_main(self, ctl: ControlPlane) -> None:
        try:
            self._sender_loop(ctl)
        except Exception as err:  # noqa: BLE001 - recorded and surfaced by put() as Closed
            self._fatal = err if isinstance(err, WeightSyncError) else WeightSyncError(
                f"sender stopped: {type(err).__name__}: {err}", channel=self.name)
            self._recorder.record("sender", channel=self.name, member=self._member).fail(self._fatal)
            self._state = "failed"
            in_flight = self._staging.in_flight
            for job in [*self._staging.drain(), *([in_flight] if in_flight is not None else [])]:
                job.handle.resolve_threadsafe(error=self._fatal)
        finally:
            self._gens.shutdown(ctl)

    def _sender_loop(self, ctl: ControlPlane) -> None:
        st = self._staging
        while not self._stop.is_set():
            with st.lock:
                while not (st.pending or self.membership.has_requests() or self._draining or self._stop.is_set()
                           or self.membership.has_dead_members()):
                    st.lock.wait(self.options.heartbeat_interval)
            if self._stop.is_set() or (self._draining and st.pending is None):
                return
            if self.membership.has_requests() or self.membership.has_dead_members():
                self._gens.advance(ctl, reason="membership change")
                retained = st.retained
                if retained is not None and st.pending is None and self.membership.lacking(retained.version):
                    self._send(ctl, retained)
            job = st.take()
            if job is not None:
                self._send(ctl, job)

    def _send(self, ctl: ControlPlane, job: Job) -> None:
        for _attempt in range(3):
            failed = self._send_once(ctl, job)
            if failed is None:
                return
            # the group is broken: rebuild with the live members and re-send this version
            self._gens.advance(ctl, reason=f"version {job.version} failed", failed=failed)
            if job.flat is None and job.handle._released.done():
                break  # copy=False tensors were released: nothing left to re-send from
        self._finish(job, time.monotonic())

    def _send_once(self, ctl: ControlPlane, job: Job) -> set[str] | None:
        """Announce and broadcast ``job`` once; None on success, else the members that failed."""
        if job.ready is not None:
            torch.cuda.current_stream(self._slot_device if self._slot_device.type == "cuda" else None).wait_event(
                job.ready)
            if self._slot_device.type != "cuda":
                job.ready.synchronize()  # gloo reads host memory: the device->host copy must be done
        members = tuple(self.membership.members)
        gen, seq, group = self.membership.generation, self._gens.next_seq(), self._gens.group
        ranges = layout.bucket_ranges(job.manifest.total_bytes, self.options.bucket_bytes)
        announce = _wire.Announce(generation=gen, seq=seq, version=job.version, manifest=job.manifest,
                                  bucket_bytes=self.options.bucket_bytes, num_buckets=len(ranges),
                                  checksum=self.checksum, resend=job.resends > 0)
        job.resends += 1
        job.started = job.started or time.monotonic()
        t0 = time.monotonic()
        entry = self._recorder.record("announce", channel=self.name, member=self._member, generation=gen,
                                      version=job.version, nbytes=job.manifest.total_bytes, peers=members).start()
        try:
            self._gens.tell(ctl, members, announce)
            entry.complete()
            if members and group is not None:
                slices, before = bucket_slices(job, ranges, self._bucket_buffers, self.options.bucket_bytes)
                sums: list[int] = []
                # each bucket's digest is taken once it is on the wire, while the next one transfers
                after = (lambda i: sums.append(layout.checksum(slices[i]))) if self.checksum else None
                group.broadcast_buckets(slices, version=job.version, deadline=self.options.deadline,
                                        op="bucket_send", before=before, after=after)
                if self.checksum:
                    self._push_seals(ctl, members, _wire.Seal(generation=gen, seq=seq, version=job.version,
                                                              checksums=tuple(sums)))
            if job.flat is None:
                job.handle.release_threadsafe()
            acked, failed = self._gens.collect_acks(ctl, gen, seq, members, job.version, self.options.timeout)
        except DATA_ERRORS as err:
            if entry.state != "completed":
                entry.fail(err)
            self._recorder.record("send", channel=self.name, member=self._member, generation=gen,
                                  version=job.version).fail(err)
            # receivers still waiting on this version give up now (their queue is no longer
            # empty) and acknowledge the failure, so live members answer and silent ones stand out
            self._gens.tell(ctl, members, _wire.Wake(reason=f"version {job.version} abandoned"))
            if self.checksum:  # a receiver past its buckets waits on its seal queue, not its queue
                self._push_seals(ctl, members, _wire.Seal(generation=gen, seq=seq, version=job.version,
                                                          checksums=(), abandoned=True))
            acked, failed = self._gens.collect_acks(ctl, gen, seq, members, job.version, self.options.timeout)
            job.members_done |= acked
            self._recorder.dump_on_trouble(f"version {job.version} failed: {err}")
            return failed or set(members) - acked
        job.members_done |= acked
        self._score(acked, job.version)
        if failed:
            self._recorder.dump_on_trouble(f"version {job.version}: no acknowledgement from {sorted(failed)}")
            return failed
        self._finish(job, t0)
        return None

    def _push_seals(self, ctl: ControlPlane, members: tuple[str, ...], seal: _wire.Seal) -> None:
        for member in members:
            queue = self._gens.seal_queue(member)
            if queue is not None:
                ctl.push(queue, seal)

    def _finish(self, job: Job, t0: float) -> None:
        members = tuple(m for m in self.membership.members if m in job.members_done)
        report = DeliveryReport(version=job.version, members=members, nbytes=job.manifest.total_bytes,
                                seconds=time.monotonic() - (job.started or t0))
        self._staging.finish(job)
        job.handle.resolve_threadsafe(report)

    # members: scoring and replacement -------------------------------------------------------
    def _score(self, acked: set[str], version: int) -> None:
        """Record receive times and act on members the policy finds slow."""
        timings = self._gens.last_timings
        own = {m: timings[m][1] for m in acked if m in timings}
        self.membership.note_delivered(acked, version, {m: timings[m][0] for m in own}, own)
        for member, ratio in self.membership.slow_members(self.policy, own).items():
            self._recorder.record("slow", channel=self.name, member=self._member, version=version,
                                  peers=(member,)).fail(f"{ratio:.1f}x the others' receive time")
            if self.policy.on_slow != "keep":
                log.warning("weightsync: %s is %.1fx slower than the others: evicting (%s)", member, ratio,
                            self.policy.on_slow)
                self.membership.request_evict(member, "slow")

    def _on_evicted(self, member: MemberInfo) -> None:
        """Sender thread: ``member`` was dropped; ask the orchestrator when the policy says so."""
        self.evicted.append(member)
        action = {"slow": self.policy.on_slow, "dead": self.policy.on_dead, "failed": self.policy.on_dead}.get(
            member.reason, "evict")  # operator evictions and leaves are not replaced
        if action != "replace" or self.orchestrator is None or self._loop is None or self._stop.is_set():
            return
        call_soon(self._loop, self._start_replacement, member)

    def _start_replacement(self, member: MemberInfo) -> None:
        """Event loop: run ``orchestrator.replace(member)`` as a task; failures are recorded."""
        assert self.orchestrator is not None
        entry = self._recorder.record("replace", channel=self.name, member=self._member,
                                      peers=(member.member_id,), error=member.reason).start()

        async def run() -> None:
            assert self.orchestrator is not None
            try:
                await self.orchestrator.replace(member)
            except Exception as err:  # noqa: BLE001 - a failed replacement must never reach put()
                entry.fail(f"{type(err).__name__}: {err}")
                log.warning("weightsync: replacing %s failed: %s", member.member_id, err)
            else:
                entry.complete()

        self.replacements.append(asyncio.ensure_future(run()))
