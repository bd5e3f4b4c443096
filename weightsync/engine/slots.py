"""Subscriber receive slots: two flat buffers, one readable and one being received into.

Buckets arrive straight into slices of the receiving slot (no bucket copies). When a version
is complete and verified, the slots swap under the lock, so a reader sees either the old or
the new version, never a torn one. Readers (``get``/``get_into`` copying out) pin the slot
they read; the receiver waits for them, within a deadline, before overwriting it.

A same-host member's slot may be *in place*: its ``flat`` is a read-only view of the publisher's
shared-memory snapshot (``planes.shm``), which the publisher does not write again while this
member reads that version (staging parks it). ``guard`` then says whether the segment is still
that version (its epoch unchanged): a read that ends with it False read bytes the publisher
reused (this member was evicted for holding it too long) and is refused. When the receiver stops,
``keep_own`` copies the readable version into private memory (the last version stays readable
after the publisher is gone) and lets go of every view, so the mappings go with it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch

from weightsync._errors import LocalFailure
from weightsync._wire import Manifest
from weightsync.engine.into import IntoDest
from weightsync.format import layout, sharding


class Slot:
    def __init__(self) -> None:
        self.flat: torch.Tensor | None = None
        self.manifest: Manifest | None = None
        self.version: int | None = None
        self.readers = 0
        self.guard: Callable[[], bool] | None = None  # in place: the segment still holds this version


class Reading(NamedTuple):
    """A pinned slot and what a read of it takes, as it was when pinned: the stopping receiver
    may drop or swap the slot's own fields while the read goes on (``SlotPair.keep_own``)."""

    slot: Slot
    flat: torch.Tensor | None
    manifest: Manifest | None
    version: int | None
    guard: Callable[[], bool] | None


class SlotPair:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cond = threading.Condition()
        self.readable = Slot()
        self.receiving = Slot()
        # a sharded channel: each trainer rank's lane writes its part into the receiving slot;
        # per lane, the version it last wrote in full there (None while it writes one)
        self._parts: dict[int, int | None] = {}
        self._epoch = 0  # bumped whenever the receiving slot's buffer or meaning changes
        self.into: IntoDest | None = None  # a get_into(as_received=True) waiting: written as received

    @property
    def version(self) -> int | None:
        return self.readable.version

    def _receiving_free(self, deadline: float) -> Slot:
        """The receiving slot once no reader holds it (under ``cond``); LocalFailure past ``deadline``."""
        slot = self.receiving
        while slot.readers:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LocalFailure("readers held the receive slot past the deadline")
            self.cond.wait(left)
        return slot

    def prepare(self, manifest: Manifest, timeout: float) -> torch.Tensor:
        """The receiving buffer for ``manifest``; waits for readers of that slot to finish."""
        deadline = time.monotonic() + timeout
        with self.cond:
            slot = self._receiving_free(deadline)
            if slot.flat is None or slot.flat.numel() < manifest.total_bytes or slot.guard is not None:
                slot.flat, slot.guard = None, None  # free first: never three buffers at once
                slot.flat = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=self.device)
            slot.manifest, slot.version = manifest, None
            return slot.flat[: manifest.total_bytes]

    def prepare_in_place(self, manifest: Manifest, view: torch.Tensor, guard: Callable[[], bool],
                         timeout: float) -> torch.Tensor:
        """The receiving slot becomes ``view`` (the publisher's snapshot, read in place); waits for
        readers of that slot to finish. Its private buffer, if it had one, is freed."""
        deadline = time.monotonic() + timeout
        with self.cond:
            slot = self._receiving_free(deadline)
            slot.flat, slot.guard = view, guard
            slot.manifest, slot.version = manifest, None
            return view

    def prepare_part(self, rank: int, manifest: Manifest, timeout: float) -> tuple[torch.Tensor, int]:
        """The receiving buffer for trainer rank ``rank``'s part of the full ``manifest``, and
        its epoch (for ``part_done``); waits for readers of that slot to finish."""
        deadline = time.monotonic() + timeout
        with self.cond:
            slot = self._receiving_free(deadline)
            if slot.flat is None or slot.flat.numel() < manifest.total_bytes or slot.manifest != manifest \
                    or slot.guard is not None:
                if slot.flat is None or slot.flat.numel() < manifest.total_bytes or slot.guard is not None:
                    slot.flat, slot.guard = None, None  # free first: never three buffers at once
                    slot.flat = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=self.device)
                slot.manifest = manifest
                self._parts, self._epoch = {}, self._epoch + 1  # what the other lanes wrote means nothing now
            slot.version = None
            self._parts[rank] = None
            return slot.flat[: manifest.total_bytes], self._epoch

    def part_done(self, rank: int, world: int, version: int, epoch: int) -> bool:
        """Rank ``rank``'s part of ``version`` is in and verified. Publishes, and returns True, once
        every rank's latest complete part is of ``version`` (never a mix of versions)."""
        with self.cond:
            if epoch != self._epoch:
                return False  # the slot was reallocated or published meanwhile: this part is gone
            self._parts[rank] = version
            complete = len(self._parts) == world and all(v == version for v in self._parts.values())
            if not complete or (self.readable.version is not None and version <= self.readable.version):
                return False
            self._parts, self._epoch = {}, self._epoch + 1
            self.publish(version)  # under the same (reentrant) lock: no lane starts writing before the swap
            return True

    def publish(self, version: int) -> None:
        """The receiving slot is complete: it becomes readable, atomically."""
        with self.cond:
            self.receiving.version = version
            self.readable, self.receiving = self.receiving, self.readable
            self.cond.notify_all()

    def pin(self) -> Slot:
        with self.cond:
            slot = self.readable
            slot.readers += 1
            return slot

    def pin_read(self) -> Reading:
        """The readable slot, pinned, with the bytes a read takes and the guard that says after the
        read whether they were its version all along, taken together: ``keep_own`` swaps an
        in-place slot's bytes for a private copy when the receiver stops, while a read that began
        on the segment goes on reading it, and only that segment's guard tells whether the
        publisher wrote it meanwhile."""
        with self.cond:
            slot = self.readable
            slot.readers += 1
            return Reading(slot, slot.flat, slot.manifest, slot.version, slot.guard)

    def pin_previous(self, version: int) -> Slot | None:
        """The receiving slot, pinned, while it still holds ``version`` untouched (the version that was
        readable before the current one), else None. The receiver waits for it as for any reader."""
        with self.cond:
            slot = self.receiving
            if slot.version != version or slot.flat is None or slot.manifest is None:
                return None
            slot.readers += 1
            return slot

    def unpin(self, slot: Slot) -> None:
        with self.cond:
            slot.readers -= 1
            self.cond.notify_all()

    def still_read(self) -> int:
        """The older version a reader still holds in place (the receiving slot's), else -1: the
        publisher keeps its buffer until the next acknowledgement (nothing is received into that
        slot before its readers are done)."""
        with self.cond:
            slot = self.receiving
            if slot.guard is not None and slot.readers and slot.version is not None:
                return slot.version
            return -1

    def keep_own(self) -> None:
        """The receiver stopped: an in-place readable version is copied into private memory (or
        dropped if the publisher wrote it meanwhile), and no slot keeps a view of its segments."""
        with self.cond:
            slot = self.readable
            if slot.guard is not None and slot.flat is not None:
                own = slot.flat.clone()
                if slot.guard():
                    slot.flat, slot.guard = own, None
                else:  # reused under us: this version is gone here
                    slot.flat = slot.manifest = slot.version = slot.guard = None
            other = self.receiving
            if other.guard is not None and not other.readers:
                other.flat = other.manifest = other.version = other.guard = None
            self.cond.notify_all()


def copy_out(read: Reading, device: torch.device) -> tuple[torch.Tensor, Manifest, int]:
    """A copy of the pinned version, on ``device``."""
    flat, manifest, version = read.flat, read.manifest, read.version
    assert flat is not None and manifest is not None and version is not None
    src = flat[: manifest.total_bytes]
    out = torch.empty_like(src, device=device)
    out.copy_(src)
    if out.is_cuda:
        torch.cuda.current_stream(out.device).synchronize()
    return out, manifest, version


def copy_into(read: Reading, dest: Mapping[str, torch.Tensor]) -> None:
    """The pinned version into ``dest``'s tensors."""
    flat, manifest = read.flat, read.manifest
    assert flat is not None and manifest is not None
    # parameters that require grad are written as data: an in-place copy into a leaf that
    # requires grad is refused by autograd (it would leave ``dest`` half written)
    with torch.no_grad():
        for spec in manifest.tensors:
            if not spec.nbytes:
                continue
            target = dest[spec.name]
            if sharding.is_dtensor(target):  # a tensor-parallel engine's shard: its own box only
                local, box = sharding.local_box(target)
                if box:
                    local.copy_(layout.tensor_view(flat, spec)[box])
            else:
                target.copy_(layout.tensor_view(flat, spec))
        layout.write_ties(flat, manifest, dest)
    if any(t.is_cuda for t in dest.values()):
        torch.cuda.synchronize()
