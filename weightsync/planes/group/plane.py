"""The dedicated group: the default data plane (gloo/NCCL broadcast of each bucket from rank 0).

Built standalone from a Store under a fresh prefix (``ws/<channel>/gen/<g>/<token>/pg``; the
store is the publisher's in-memory rendezvous table, see :mod:`weightsync.control.rendezvous`), never through
``init_process_group``: the user's default group is untouched and any number of channels can
live in one process. Exactly one backend object per group, hence one communicator.

:class:`GroupPlane` is what the Sender and Receiver drive (see
:mod:`weightsync.planes.dataplane`); it owns, per end:

- one :class:`DedicatedGroup` per generation, built in ``enter`` (the rendezvous runs in the
  calling thread, bounded) and aborted in ``leave``; an aborted group is never used again;
- or, where torch can re-form a backend in place (2.14+, gloo), one :class:`Reconfigurable`
  backend for the whole membership: ``offer`` is its handle, and ``enter`` re-forms it with the
  uuid and every member's handle from the publisher's ``Go`` (tens of milliseconds, no new
  sockets to the store). The generation's DedicatedGroup then only borrows it.

This module is one of the two places where torch backend errors are translated (see
:mod:`weightsync._errors`): a failed or late collective is a ``PeerFailure``; a failing
``before``/``after`` hook is this end's own ``LocalFailure``.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from weightsync import _torch_compat as compat
from weightsync._errors import Cancelled, InternalError, LocalFailure, PeerFailure, own_hook
from weightsync.planes.dataplane import GenerationSpec, Transfer
from weightsync.planes.group.reaper import PUBLISHER_GRACE, retire
from weightsync.recorder.recorder import FlightRecorder

log = logging.getLogger("weightsync.planes")


def generation_prefix(channel: str, spec: GenerationSpec) -> str:
    """Where a dedicated group's backend keeps its rendezvous keys (a fresh random token per generation)."""
    return f"ws/{channel}/gen/{spec.generation}/{spec.rendezvous}/pg"


def reconfigure_prefix(channel: str) -> str:
    """Where every member's reconfigurable backend keeps its keys; each re-form adds its uuid."""
    return f"ws/{channel}/rc"

ALIVE, ABORTED = "alive", "aborted"
WAIT_SLICE = 0.25
STUCK_SLACK = 2.0  # seconds past its own timeout an in-place re-form is waited on (Reconfigurable.enter)


def resolve_backend(backend: str, device: torch.device) -> str:
    """``"auto"`` -> ``"nccl"`` for CUDA devices with NCCL, else ``"gloo"``; validates names."""
    if backend not in ("auto", "gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    if backend == "auto":
        return "nccl" if device.type == "cuda" and compat.nccl_available() else "gloo"
    if backend == "nccl" and not compat.nccl_available():
        raise ValueError("backend='nccl' needs a CUDA device and a torch built with NCCL")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"backend='nccl' needs a CUDA device, got device={device}")
    if not compat.gloo_available():
        raise ValueError("this torch build has no gloo backend")
    return backend


def reconfigure_enabled(backend: str) -> bool:
    """True when generations re-form one backend in place (gloo on torch 2.14+).

    ``WEIGHTSYNC_RECONFIGURE=0`` forces the rebuild path (a fresh group per generation).
    NCCL always rebuilds: nccl2's in-place reconfigure is not verified on a GPU yet.
    """
    if os.environ.get("WEIGHTSYNC_RECONFIGURE", "1") == "0":
        return False
    return backend == "gloo" and compat.gloo_options_reconfigurable()


class DedicatedGroup:
    """A standalone process group for one generation of one channel."""

    def __init__(self, pg: Any, *, channel: str, member: str, generation: int, rank: int, size: int,
                 recorder: FlightRecorder, store: Any = None, borrowed: bool = False) -> None:
        self._pg = pg
        self.channel, self.member, self.generation, self.rank, self.size = channel, member, generation, rank, size
        self._recorder = recorder
        self._rec = recorder.scope(channel, member)
        self._store = store
        self._borrowed = borrowed  # the backend belongs to a Reconfigurable: never torn down here
        self._orphans: list[Any] = []  # works of a failed transfer, handed to the reaper on abort
        self.state = ALIVE

    @classmethod
    def build(cls, store: Any, *, channel: str, member: str, spec: GenerationSpec, backend: str,
              device: torch.device, recorder: FlightRecorder, max_ctas: int = 4,
              host: str | None = None, streams: int = 1) -> DedicatedGroup:
        """Rendezvous with the other members; blocks at most ``spec.timeout`` seconds.

        ``store`` is a connection owned by the calling thread; it is cloned, never shared.
        """
        size = len(spec.members) + 1
        entry = recorder.record("rebuild", channel=channel, member=member, generation=spec.generation,
                                peers=spec.members).start()
        own = None
        try:
            if size == 1 and backend == "gloo":
                pg = None  # a publisher alone needs no communicator
            else:
                # the backend keeps using its store (rendezvous, lazily connected pairs) from
                # its own threads: it gets a connection of its own, never one we wait on
                own = compat.clone_store(store, spec.timeout)
                # under the generation's random token: nobody can pre-write a future generation's keys
                prefixed = compat.prefix_store(generation_prefix(channel, spec), own)
                if backend == "nccl":
                    pg = compat.make_nccl(prefixed, spec.rank, size, spec.timeout, device, max_ctas)
                else:
                    pg = compat.make_gloo(prefixed, spec.rank, size, spec.timeout, host, streams)
        except Exception as err:
            entry.fail(err)
            log.warning("%s: the %s group of generation %d did not form: %s", member, backend, spec.generation, err)
            raise PeerFailure(f"rendezvous of generation {spec.generation} failed: {err}") from err
        entry.complete()
        log.debug("%s: built the %s group of generation %d (rank %d of %d)", member, backend, spec.generation,
                  spec.rank, size)
        return cls(pg, channel=channel, member=member, generation=spec.generation, rank=spec.rank, size=size,
                   recorder=recorder, store=own)

    def broadcast(self, transfer: Transfer, *, op: str, depth: int = 2) -> None:
        """Broadcast each bucket from rank 0, keeping up to ``depth`` buckets in flight.

        Raises PeerFailure when a bucket
        misses its deadline or the backend fails (the group is then unusable), Cancelled when
        ``transfer.cancelled()`` says so, LocalFailure when a hook fails.
        """
        self._run(transfer, op, depth, lambda i, tensor, limit: [compat.broadcast(self._pg, tensor, 0, limit)])

    def exchange(self, transfer: Transfer, sends: Callable[[int], Sequence[tuple[int, torch.Tensor]]] | None, *,
                 op: str, depth: int = 2) -> None:
        """Point to point: rank 0 sends each member what ``sends(i)`` says for bucket i (``(rank,
        bytes)`` pairs); a member receives ``transfer.buckets[i]`` (nothing when it is empty).
        Bounds and failures as :meth:`broadcast`."""
        def issue(i: int, tensor: torch.Tensor, limit: float) -> list[Any]:
            if self.rank != 0:
                return [compat.recv(self._pg, tensor, 0, i)] if tensor.numel() else []
            assert sends is not None
            try:
                pairs = sends(i)
            except Exception as err:  # noqa: BLE001 - gathering our own bucket: a local failure
                raise LocalFailure(f"gathering bucket {i} failed: {type(err).__name__}: {err}") from err
            works: list[Any] = []
            try:
                for dst, piece in pairs:
                    if piece.numel():
                        works.append(compat.send(self._pg, piece, dst, i))
            except Exception:
                self._orphans.extend(works)  # those already issued: the reaper's, like any hung work
                raise
            return works

        # rank 0 sends each member its own: a bucket's deadline covers all of them
        self._run(transfer, op, depth, issue, fan=self.size - 1 if self.rank == 0 else 1, whole=True)

    def _run(self, transfer: Transfer, op: str, depth: int,
             issue: Callable[[int, torch.Tensor, float], list[Any]], fan: int = 1, whole: bool = False) -> None:
        """Issue each bucket (``depth`` in flight) and wait for it; ``whole``: point-to-point works,
        each waited on in one piece (:meth:`_wait_whole`)."""
        if self.state != ALIVE:
            raise Cancelled(f"generation {self.generation} of {self.channel!r} was aborted")
        if self._pg is None:
            return
        pending: list[tuple[int, list[Any], Any, float]] = []  # (bucket, works, recorder entry, deadline)
        try:
            for i in range(len(transfer.buckets)):
                if len(pending) >= depth:
                    self._finish_oldest(pending, transfer, whole)
                if transfer.cancelled is not None and transfer.cancelled():
                    # polled here too: where every wait finds its bucket already done (a receiver
                    # slower than the wire) it would never be polled, and abort() would wait out the version
                    raise Cancelled(f"told to stop before bucket {i}")
                own_hook(transfer.before, i, "preparing")
                tensor = transfer.buckets[i]  # after its hook: a delta's wire bucket exists once encoded (or sized)
                limit = transfer.deadline(tensor.numel() * max(fan, 1))
                entry = self._rec.record(op, generation=self.generation, version=transfer.version, bucket=i,
                                         nbytes=tensor.numel(), encoding=transfer.encoding,
                                         base=transfer.base).start()
                pending.append((i, [], entry, time.monotonic() + limit))
                try:
                    if whole:  # a first send or receive connects its pair (lazily), in the calling thread
                        works = self._bounded(functools.partial(issue, i, tensor, limit), pending[-1][3],
                                              transfer.cancelled,
                                              f"the generation ended while bucket {i} was issued", late=True)
                    else:
                        works = issue(i, tensor, limit)
                except InternalError:
                    raise
                except Exception as err:  # noqa: BLE001 - whatever the backend raises (pybind maps C++
                    # exceptions to ValueError, MemoryError, ...): this step failed, never the thread
                    raise PeerFailure(f"bucket {i} could not be issued: {type(err).__name__}: {err}") from err
                pending[-1] = (i, works, entry, time.monotonic() + limit)
            while pending:
                self._finish_oldest(pending, transfer, whole)
        except BaseException as err:
            for _, works, entry, _ in pending:  # buckets still in flight will never complete
                entry.fail(f"abandoned: {err}", aborted=True)
                # a work still hung on a dead peer blocks whoever destroys it (measured on 2.13: a
                # receiver stuck for seconds in a plain assignment): the reaper destroys them later
                self._orphans.extend(works)
            raise

    def _finish_oldest(self, pending: list[tuple[int, list[Any], Any, float]], transfer: Transfer,
                       whole: bool = False) -> None:
        """Wait for the oldest bucket's works; once they completed nothing here holds them (a work
        keeps its tensors alive: a gathered piece for a sliced member is freed with it)."""
        i, works, entry, limit = pending.pop(0)
        wait = self._wait_whole if whole else self._wait
        try:
            for work in works:
                wait(work, limit, transfer.cancelled)
        except BaseException as err:
            entry.fail(err)
            self._orphans.extend(works)
            raise
        entry.complete()
        own_hook(transfer.after, i, "checking")

    @staticmethod
    def _wait(work: Any, limit: float, cancelled: Callable[[], bool] | None) -> None:
        while True:
            left = limit - time.monotonic()
            step = left if cancelled is None else min(left, WAIT_SLICE)
            try:
                compat.wait_work(work, max(step, 0.001))
                return
            except TimeoutError as err:
                if left <= WAIT_SLICE or cancelled is None:
                    raise PeerFailure(f"a bucket missed its deadline: {err}") from err
            except InternalError:
                raise
            except Exception as err:  # noqa: BLE001 - the backend failed (a peer reset, closed, or sent garbage)
                raise PeerFailure(f"{type(err).__name__}: {err}") from err
            if cancelled():
                raise Cancelled("the generation ended while this bucket was on the wire")

    def _bounded(self, call: Callable[[], Any], limit: float, cancelled: Callable[[], bool] | None, stop: str,
                 late: bool = False) -> Any:
        """``call()`` in a thread of its own, waited on until ``limit`` (monotonic) while this one
        polls ``cancelled`` every slice (Cancelled(``stop``) when it says so). Point-to-point gloo
        calls need it twice over: a send or receive wait that times out closes every pair of the
        group (so none is waited on in slices), and the first send or receive to a peer connects
        its pair in the calling thread, up to the backend's timeout (a member that left meanwhile:
        measured on torch 2.13, a lane rank's sender thread blocked there while joins went
        unanswered for 10 s). A call left behind ends with the group (abort tears the backend
        down) or at the backend's own timeout; ``late``: the works it returns then are the reaper's."""
        done, box, given_up = threading.Event(), {}, threading.Event()

        def run() -> None:
            try:
                box["value"] = call()
                if late and given_up.is_set():
                    self._orphans.extend(box["value"])
            except BaseException as err:  # noqa: BLE001 - handed to the waiting thread below
                box["error"] = err
            finally:
                done.set()

        threading.Thread(target=run, name="ws-p2p", daemon=True).start()
        try:
            while not done.wait(max(min(WAIT_SLICE, limit - time.monotonic()), 0.001)):
                if cancelled is not None and cancelled():
                    raise Cancelled(stop)
                if time.monotonic() > limit + 2.0:  # its own timed wait should have ended it by now
                    raise PeerFailure("a bucket missed its deadline (its wait did not return)")
        except InternalError:
            given_up.set()
            if late and "value" in box:
                self._orphans.extend(box["value"])
            raise
        if "error" in box:
            raise box["error"]
        return box.get("value")

    def _wait_whole(self, work: Any, limit: float, cancelled: Callable[[], bool] | None) -> None:
        """A point-to-point work, waited on once until ``limit``, never in slices (:meth:`_bounded`)."""
        try:
            self._bounded(lambda: compat.wait_work(work, max(limit - time.monotonic(), 0.001)), limit, cancelled,
                          "the generation ended while this bucket was on the wire")
        except InternalError:
            raise
        except TimeoutError as err:
            raise PeerFailure(f"a bucket missed its deadline: {err}") from None
        except Exception as err:  # noqa: BLE001 - the backend failed (a peer reset, closed, or sent garbage)
            raise PeerFailure(f"{type(err).__name__}: {err}") from None

    def abort(self, reason: str = "", grace: float = 0.0) -> None:
        """End this generation; safe to call twice and from error paths. ``grace``: seconds the
        backend is kept before it is torn down (``reaper.retire``)."""
        if self.state == ABORTED:
            return
        self.state = ABORTED
        entry = self._rec.record("abort", generation=self.generation,
                                      error=reason).start()
        # a borrowed backend is re-formed by the next reconfigure: only its hung works go
        handoff = [None if self._borrowed else self._pg, self._store, self._orphans]
        self._pg, self._store, self._orphans = None, None, []
        retire(handoff, entry, after=grace)


class Reconfigurable:
    """One member's gloo backend for its whole membership, re-formed in place every generation."""

    def __init__(self, store: Any, *, channel: str, member: str, slot: int, timeout: float,
                 recorder: FlightRecorder, host: str | None = None, streams: int = 1) -> None:
        self.channel, self.member, self.slot = channel, member, slot
        self._recorder = recorder
        self._rec = recorder.scope(channel, member)
        self._store = compat.clone_store(store, timeout)
        # every member's backend shares this prefix: the rendezvous keys live under the uuid
        self._pg = compat.make_gloo_reconfigurable(compat.prefix_store(reconfigure_prefix(channel), self._store), slot,
                                                   timeout, host, streams)
        self._reforming: threading.Thread | None = None  # the last re-form's thread (see enter)

    def handle(self) -> str:
        return compat.reconfigure_handle(self._pg)

    def enter(self, spec: GenerationSpec) -> DedicatedGroup:
        """Re-form the backend with ``spec.offers`` (rank = position) as generation ``spec.generation``.

        gloo re-forms on the calling thread and, measured on 2.15, does not keep to the re-form's
        own timeout when a peer dies between publishing its address and connecting to everyone:
        the ranks it had not reached yet waited about 45 s for it (``connectFullMesh ... Connect
        timeout``) against a bound of 11 s. An honest member stuck there missed the next two
        generations and was evicted; a publisher stuck there held every version. So the re-form
        runs on its own thread and is waited on for its timeout and ``STUCK_SLACK`` more; past
        that it is this generation's failure, the backend is :attr:`stuck` (``GroupPlane.leave``
        replaces it before anything else touches it), and its teardown waits for that thread.
        """
        entry = self._rec.record("reconfigure", generation=spec.generation, peers=spec.members).start()
        failure: list[BaseException] = []
        self._reforming = threading.Thread(target=_reform, args=([self._pg], spec, failure), daemon=True,
                                           name=f"ws-{self.channel}-reconfigure")
        self._reforming.start()
        self._reforming.join(spec.timeout + STUCK_SLACK)
        if self.stuck:
            failure.append(TimeoutError(f"gloo's re-form still blocked after {spec.timeout + STUCK_SLACK:.3g} s "
                                        f"(its own timeout is {spec.timeout:.3g} s): a peer left mid-connect"))
        if failure:
            err = failure[-1]
            entry.fail(err)
            log.warning("%s: re-forming generation %d in place failed: %s", self.member, spec.generation, err)
            raise PeerFailure(f"re-forming generation {spec.generation} failed: {err}") from None
        entry.complete()
        return DedicatedGroup(self._pg, channel=self.channel, member=self.member, generation=spec.generation,
                              rank=spec.rank, size=len(spec.offers), recorder=self._recorder, borrowed=True)

    @property
    def stuck(self) -> bool:
        """Whether a re-form is still blocked inside gloo (see :meth:`enter`)."""
        return self._reforming is not None and self._reforming.is_alive()

    def close(self, grace: float = 0.0) -> None:
        """Tear the backend down (off this thread, after ``grace`` s, and after a re-form still
        blocked in it has returned); the object is not used again."""
        if self._pg is None:
            return
        entry = self._rec.record("abort", error="closed").start()
        handoff = [self._pg, self._store, self._reforming]
        self._pg, self._store, self._reforming = None, None, None
        retire(handoff, entry, after=grace)


def _reform(pg: list[Any], spec: GenerationSpec, failure: list[BaseException]) -> None:
    """``compat.reconfigure`` on a thread of its own (:meth:`Reconfigurable.enter`); the backend
    travels in a list emptied first, so no frame here outlives the call holding it."""
    backend = pg.pop()
    try:
        compat.reconfigure(backend, spec.uuid, spec.offers, spec.timeout)
    except Exception as err:  # noqa: BLE001 - handed to the waiting thread
        err.__traceback__ = None  # its frames hold the backend: the reaper drops the last reference
        failure.append(err)
    finally:
        del backend


class GroupPlane:
    """The dedicated-group data plane of one channel end (see the module docstring).

    Args:
        store: the rendezvous store (the publisher's table, or a member's view of it; cloned per backend).
        channel, member: names for the recorder and the store prefixes.
        backend, device: ``"gloo"``/``"nccl"`` and where buckets live.
        in_place: re-form one backend per membership instead of building one per generation.
        slot: with ``in_place``, this end's creation rank, unique in the channel.
        timeout: bound of creating the in-place backend.
        host: the local address gloo binds (this end's control-connection address; see
            ``_torch_compat.gloo_device``); None for gloo's default.
        streams: gloo connections per pair (``ChannelSettings.streams``: every end the same).
    """

    in_group, moves_alone = True, False

    def __init__(self, store: Any, *, channel: str, member: str, backend: str, device: torch.device,
                 recorder: FlightRecorder, in_place: bool = False, slot: int = 0, timeout: float = 30.0,
                 host: str | None = None, streams: int = 1) -> None:
        self._store, self.channel, self.member, self.host = store, channel, member, host
        self.streams = streams
        self.backend, self.device, self.in_place, self.slot = backend, device, in_place, slot
        self._recorder = recorder
        self._timeout = timeout
        self._backend: Reconfigurable | None = None
        self.group: DedicatedGroup | None = None

    def broadcast_parent(self, rank: int) -> int | None:
        """The rank that forwards ``rank``'s bytes in a broadcast from rank 0, or None when unknown.

        gloo's broadcast (``gloo/broadcast.cc``) is a binomial tree: rank r receives from r with
        its highest bit cleared (1 and 2 from the root, 3 from 1, 5 from 1, 6 from 2, 7 from 3).
        NCCL's rings and trees are its own business: None.
        """
        if self.backend != "gloo" or rank <= 0:
            return None
        return rank - (1 << (rank.bit_length() - 1))

    def rendezvous_prefixes(self, spec: GenerationSpec) -> tuple[str, ...]:
        """The keys a member of ``spec`` may touch: this generation's and no other's."""
        if spec.offers:  # re-formed in place: the re-form's own keys, under its uuid
            return (f"{reconfigure_prefix(self.channel)}/{compat.reconfigure_keys(spec.uuid)}",)
        return (f"{generation_prefix(self.channel, spec)}/",)

    def offer(self) -> str:
        if not self.in_place:
            return ""
        if self._backend is None:
            try:
                self._backend = Reconfigurable(self._store, channel=self.channel, member=self.member, slot=self.slot,
                                               timeout=self._timeout, recorder=self._recorder, host=self.host,
                                               streams=self.streams)
            except Exception as err:  # noqa: BLE001 - any backend error is this step's failure
                raise PeerFailure(f"could not create the reconfigurable backend: {type(err).__name__}: {err}") \
                    from err
        return self._backend.handle()

    def enter(self, spec: GenerationSpec) -> None:
        self.leave("entering the next generation")
        if spec.offers:
            if self._backend is None:
                raise PeerFailure("asked to re-form in place without a backend (offer() was not called)")
            self.group = self._backend.enter(spec)
        elif self.in_place and not spec.members:
            self.group = DedicatedGroup(None, channel=self.channel, member=self.member, generation=spec.generation,
                                        rank=0, size=1, recorder=self._recorder)
        else:
            self.group = DedicatedGroup.build(self._store, channel=self.channel, member=self.member, spec=spec,
                                              backend=self.backend, device=self.device, recorder=self._recorder,
                                              host=self.host, streams=self.streams)

    def move(self, transfer: Transfer) -> None:
        """Rank 0: broadcast the buckets. A member: receive them, point to point where the Announce
        says so (a generation with sliced members)."""
        if self.group is None:
            raise Cancelled("no generation entered")
        op = "bucket_send" if self.group.rank == 0 else "bucket_recv"
        if self.group.rank != 0 and transfer.announce.direct:
            self.group.exchange(transfer, None, op=op)
        else:
            self.group.broadcast(transfer, op=op)

    def send_each(self, transfer: Transfer, sends: Callable[[int], Sequence[tuple[int, torch.Tensor]]]) -> None:
        """Rank 0 of a point-to-point version: bucket i's ``(rank, bytes)`` pairs are ``sends(i)``."""
        if self.group is None:
            raise Cancelled("no generation entered")
        self.group.exchange(transfer, sends, op="bucket_send")

    def view_of(self, announce: Any) -> None:
        """Nothing is read in place: every version is received into the slot."""
        return None

    def leave(self, reason: str, *, failed: bool = False) -> None:
        # a failed generation's publisher end is torn down after its peers' (reaper.retire)
        grace = PUBLISHER_GRACE if failed and self.member == "publisher" and reason != "closed" else 0.0
        if self.group is not None:
            self.group.abort(reason, grace)
            self.group = None
        if self._backend is not None and (failed or self._backend.stuck):
            # works still hung on the old backend's threads would block a re-formed one
            # (measured on 2.15): the next generation starts from a fresh backend
            self._backend.close(grace)
            self._backend = None

    def close(self) -> None:
        self.leave("closed", failed=True)
