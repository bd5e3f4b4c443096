"""Retired backends are torn down here, off the threads that retired them.

Measured on torch 2.13: gloo's ``abort()`` of a group whose peer is frozen (SIGSTOP) blocked
6.8 s, long enough for that member to miss the next generation's rendezvous. Nothing is sent on
a retired group again (its owner abandoned it first), so tearing it down can wait; the
recorder entry completes when it is really gone. ``aclose`` drains it (bounded): a backend
still being torn down when the interpreter exits takes the process down with it
("terminate called without an active exception").

Each teardown is bounded too (``Reaper.STUCK``). Measured on torch 2.13 (lazily connected gloo
pairs): a receive posted on a pair its peer never connected (the publisher gave the version up
before sending, or the relay above was killed first) waits for that connection with no
deadline, and the backend's destructor waits for the receive; neither ``abort()`` nor
``shutdown()`` wakes it (tests/test_unit.py says where it was seen). Such a teardown is
left on its own thread, the flight recorder says so, and the teardowns after it go on.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from weightsync import _torch_compat as compat

PUBLISHER_GRACE = 3.0  # seconds rank 0 keeps a retired group before tearing it down (see retire)

#: held while a backend is torn down here, and by whoever forks this process (the orchestrator's
#: replacements): the two never overlap. Seen 4 times on 2.13 in the soak test, always while a
#: replacement was being forked, beside a retired group's teardown: gloo's loop thread ended the
#: process (``EnforceNotMet ... pair.cc: state_ <= CONNECTED. 5 vs 4``, an event on a closed
#: pair). A socket closed while a forked child still holds its duplicate (until the child closes
#: its descriptors and execs) stays registered with the parent's epoll; a teardown that closes
#: without deregistering then gets events for a pair that is gone.
TEARDOWN = threading.Lock()

log = logging.getLogger("weightsync.planes")


class Reaper:
    """One daemon thread, started on demand, that aborts retired backends in turn."""

    IDLE_EXIT = 30.0
    #: seconds one teardown may take before it is left behind: above the longest measured
    #: (6.8 s, an abort beside a frozen peer), below every close's bound (3 x its timeout)
    STUCK = 10.0

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[list[Any], Any, float]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._busy = False
        self._idle = threading.Condition()
        self.stuck = 0  # teardowns left behind (each still blocked on its own thread)

    def retire(self, handoff: list[Any], entry: Any, after: float = 0.0) -> None:
        self._queue.put((handoff, entry, time.monotonic() + after))
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="ws-group-reaper", daemon=True)
                self._thread.start()

    def drain(self, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until every retired backend is torn down.

        Called by ``aclose``: a backend still being torn down when the interpreter exits
        takes the process down with it (``terminate called without an active exception``).
        """
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                thread = self._thread
                busy = thread is not None and (not self._queue.empty() or self._busy)
            if not busy:
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with self._idle:
                self._idle.wait(min(left, 0.5))

    def _run(self) -> None:
        while True:
            try:
                handoff, entry, due = self._queue.get(timeout=self.IDLE_EXIT)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            self._busy = True
            time.sleep(max(due - time.monotonic(), 0.0))  # a grace the retiring end asked for (see retire)
            items = handoff[:]
            handoff.clear()  # from here on, the teardown thread holds the only references
            done = threading.Event()
            with TEARDOWN:  # never while this process forks (see TEARDOWN); a stuck teardown closed nothing yet
                threading.Thread(target=_tear_down, args=(items, done), name="ws-group-teardown",
                                 daemon=True).start()
                del items
                finished = done.wait(self.STUCK)
            if finished:
                entry.complete()
            else:
                self.stuck += 1
                entry.fail(f"teardown still blocked after {self.STUCK:.0f} s (a receive or a re-form waits on a "
                           "connection its peer never made): left on its own thread")
                log.warning("a retired gloo backend is still being torn down after %.0f s: left behind (%d so far)",
                            self.STUCK, self.stuck)
            with self._idle:
                self._busy = self._queue.qsize() > 0
                self._idle.notify_all()


def _tear_down(items: list[Any], done: threading.Event) -> None:
    """Abort the backend (``items[0]``) and drop every reference: the destructors (the backend's,
    hung works') run here, on a thread nobody waits on without a bound. A thread among the items
    is a re-form still blocked in the backend (``Reconfigurable.enter``): it returns first.

    No local name may hold an item past ``items.clear()``: its destructor (a hung work's, waiting on
    a frozen peer) would run after ``done``, and a close's drain would let the interpreter exit
    in the middle of it ("terminate called without an active exception", seen in CI on 2.13)."""
    for thread in [item for item in items if isinstance(item, threading.Thread)]:
        thread.join()
    if items and items[0] is not None:
        compat.abort(items[0])
    items.clear()
    done.set()


_reaper = Reaper()


def drain_retired(timeout: float) -> bool:
    """Wait until retired groups are torn down (see :class:`Reaper`); False on timeout."""
    return _reaper.drain(timeout)


def left_behind() -> int:
    """Teardowns this process left behind so far (``Reaper.STUCK``): each still holds its backend,
    and that backend's descriptors, until the process ends (torch 2.13, docs/torch-versions.md)."""
    return _reaper.stuck


def retire(handoff: list[Any], entry: Any, after: float = 0.0) -> None:
    """Hand a backend (``handoff[0]``; None: nothing to abort) and whatever must die with it (its
    store, hung works) over for teardown; completes ``entry`` once they are gone.

    The caller must hold no other reference: measured on 2.13, when the caller's own local
    variable outlived the reaper's, the backend's destructor (which joins gloo threads hung on a
    dead peer) ran on the caller's thread and blocked it for seconds. So ownership travels in
    a list the reaper empties, never in a variable.

    ``after``: seconds to keep it first. The publisher (rank 0) keeps a retired gloo group
    ``PUBLISHER_GRACE`` seconds, so that its peers, which retire theirs as soon as they hear of
    the next generation, have closed their ends and its own device thread has seen those
    connections close before it tears its end down. Seen twice in CI on torch 2.13 when both
    happened at once: gloo's device thread handled an event for a pair the teardown had just
    closed (``pair.cc: state_ <= CONNECTED``) and the whole process aborted.
    """
    _reaper.retire(handoff, entry, after)
