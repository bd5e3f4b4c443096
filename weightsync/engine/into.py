"""``get_into(dest, as_received=True)``: a version written into the caller's tensors as it arrives.

A plain ``get_into`` copies a version out of the readable slot once the whole version is in and
verified: one more pass over every byte after the last bucket came. While a call with
``as_received=True`` waits for a version, the receiver also writes each tensor of the version it
receives into ``dest`` as soon as the buckets holding it are in, so that copy overlaps the wire
instead of following it. The slot still receives the whole version, which is verified and made
readable as always; the call returns once it is, with nothing left to copy.

What the caller gives up: while the call waits, ``dest`` is the receiver's. It may hold part of a
version in flight, and one that then fails its checks stays partly written until the next version
is written over it (the call goes on waiting for that one). The call never returns a version
``dest`` does not hold whole and verified. Only a whole, unsliced version over the group or a
private shared-memory copy, into host memory, is written ahead (not a lane's part, a sliced
member's boxes, a version read in place, one received on a GPU, nor one that waits for the
publisher's Commit); any other version is copied as a plain ``get_into`` copies it.

How it is written: with checksums on, the receiver walks each bucket in pieces of ``PIECE``
bytes, digesting a piece and then copying it into ``dest`` while it is still in the CPU's cache
(:meth:`DestWriter.digest_and_write`): one read of the bucket from memory where a digest pass
and a copy pass took two. A plain CPU tensor of ``dest`` (contiguous, not a ``DTensor``, not an
inference tensor) takes its bytes piece by piece with ``memmove`` on the receiver's thread
(torch's in-place counter is bumped once it is whole, as ``copy_`` bumps it); any other is
copied whole with ``copy_`` once every bucket holding it is in.

The receiver thread and the waiting call share one lock: the receiver holds it while it writes
one piece (or, without checksums, one bucket), and the call takes it to end the arrangement,
after which nothing more is written.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Mapping

import torch

from weightsync._wire import Manifest
from weightsync.errors import ManifestMismatch
from weightsync.format import layout
from weightsync.format.checksum import Running

log = logging.getLogger("weightsync.subscriber")

PIECE = 1 << 20  # bytes digested then copied while in cache (256 KiB-4 MiB ran alike on the 2-core EPYC)


def _plain(tensor: torch.Tensor, nbytes: int) -> bool:
    """``tensor``'s ``nbytes`` may be written as raw bytes: one contiguous run of host memory
    that torch reads as it is (no conjugate or negative view bit), with a version counter."""
    return (type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.device.type == "cpu"
            and tensor.is_contiguous() and not tensor.is_conj() and not tensor.is_neg()
            and not tensor.is_inference() and tensor.numel() * tensor.element_size() == nbytes)


class IntoDest:
    """One waiting ``get_into(as_received=True)``: its destination and what was written there."""

    def __init__(self, dest: Mapping[str, torch.Tensor], min_version: int | None) -> None:
        self.dest = dest
        self.min_version = min_version
        self.lock = threading.Lock()
        self.open = True  # False once the call took dest back: nothing more is written
        self.touched = False  # something was written: dest no longer holds what it held before
        self.done: int | None = None  # the version written whole, then verified

    def writer(self, version: int, manifest: Manifest, flat: torch.Tensor) -> DestWriter | None:
        """A writer of ``version`` (received into ``flat``) into ``dest``, or None where this
        destination does not take it (closed, already holds one, too old, another layout)."""
        with self.lock:
            if not self.open or self.done is not None or (self.min_version is not None
                                                           and version < self.min_version):
                return None
        try:
            layout.check_destination(manifest, self.dest)
        except ManifestMismatch:
            return None  # copied as a plain get_into copies it, which names the mismatch
        return DestWriter(self, version, manifest, flat)

    def close(self) -> None:
        """Take ``dest`` back: waits for a bucket's writes in flight, then nothing more is written."""
        with self.lock:
            self.open = False


class DestWriter:
    """Writes one version's tensors into an ``IntoDest`` in the slot's byte order."""

    def __init__(self, target: IntoDest, version: int, manifest: Manifest, flat: torch.Tensor) -> None:
        self._target = target
        self._version = version
        self._manifest = manifest
        self._flat = flat
        self._specs = sorted((s for s in manifest.tensors if s.nbytes), key=lambda s: s.offset)
        self._next = 0  # the first spec not written whole yet
        self._at = 0  # the slot's bytes below this are in dest (of the plain tensor being written)
        self._live = True

    def upto(self, end: int) -> None:
        """The slot's bytes below ``end`` are in: write everything below it (a tensor that is not
        plain only once it lies wholly below)."""
        with self._target.lock:
            self._write(end)

    def digest_and_write(self, lo: int, hi: int, kind: str) -> int:
        """The slot's bytes ``[lo, hi)`` (one bucket) are in: their digest ``kind``, taken piece by
        piece with each piece written into ``dest`` right after it is read."""
        running = Running(kind)
        for a in range(lo, hi, PIECE):
            b = min(a + PIECE, hi)
            running.update(self._flat[a:b])
            with self._target.lock:
                self._write(b)
        return running.value()

    def finish(self) -> bool:
        """The version is verified: write what is left and its tied names; True if ``dest`` holds
        all of it now (the call that waits may return it without a copy)."""
        with self._target.lock:
            self._write(self._manifest.total_bytes)
            if not self._live:
                return False
            dest = self._target.dest
            try:
                with torch.no_grad():
                    layout.write_ties(self._flat, self._manifest, dest)
                if any(t.is_cuda for t in dest.values()):
                    torch.cuda.synchronize()
            except RuntimeError as err:
                return self._give_up(err)
            self._target.done = self._version
            return True

    def _write(self, end: int) -> None:  # under the target's lock
        if not self._live:
            return
        if not self._target.open:
            self._live = False
            return
        dest, specs = self._target.dest, self._specs
        try:
            # parameters that require grad are written as data (as a plain get_into writes them)
            with torch.no_grad():
                while self._next < len(specs):
                    spec = specs[self._next]
                    stop = spec.offset + spec.nbytes
                    target = dest[spec.name]
                    if _plain(target, spec.nbytes):  # byte by byte, as far as the slot is in
                        a, b = max(self._at, spec.offset), min(end, stop)
                        if b > a:
                            self._target.touched = True
                            ctypes.memmove(target.data_ptr() + (a - spec.offset), self._flat.data_ptr() + a, b - a)
                            self._at = b
                        if stop > end:
                            return
                        torch.autograd.graph.increment_version(target)  # as the copy_ it stands for would
                    else:
                        if stop > end:
                            return
                        self._target.touched = True
                        target.copy_(layout.tensor_view(self._flat, spec))
                    self._next += 1
        except RuntimeError as err:  # dest was changed under us (freed, resized): the plain copy says so
            self._give_up(err)

    def _give_up(self, err: RuntimeError) -> bool:
        self._live = False
        log.warning("version %d could not be written into the destination as it arrived (%s); it is "
                    "copied once readable", self._version, err)
        return False
