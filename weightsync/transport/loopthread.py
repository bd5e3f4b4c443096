"""Drive weightsync's async API from synchronous code: one event loop in a thread of its own.

Used by the blocking API (:mod:`weightsync.blocking`), the vLLM workers, and the publisher's
replacements (an orchestrator's ``replace`` runs here, so a blocked application loop never
delays a replacement). A host such as a vLLM worker calls plain methods on its own thread. The Publisher or
Subscriber it owns lives on a private event loop in one daemon thread, and every call into it
is bounded: a coroutine that has not finished by its bound is cancelled and SyncTimeout is
raised in the caller, so a host thread never waits without a deadline.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from weightsync.errors import SyncTimeout

T = TypeVar("T")


class LoopThread:
    """One event loop running in a daemon thread, for one host-side object."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Start ``coro`` on the loop without waiting for it (any thread)."""
        if not self.alive:
            coro.close()
            raise RuntimeError("the weightsync loop thread has stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], bound: float, what: str) -> T:
        """Run ``coro`` on the loop and return its result; at most ``bound`` seconds."""
        if not self.alive:
            coro.close()
            raise RuntimeError(f"{what}: the weightsync loop thread has stopped")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout=bound)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise SyncTimeout(f"{what} did not finish within {bound:.3g}s") from None

    def close(self, bound: float = 5.0) -> None:
        """Stop the loop (after cancelling what still runs on it) and join the thread."""
        if not self.alive:
            return

        async def cancel_rest() -> None:
            rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in rest:
                task.cancel()
            if rest:
                await asyncio.wait(rest, timeout=bound)

        try:
            self.run(cancel_rest(), bound + 1.0, "stopping the weightsync loop")
        except SyncTimeout:
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(bound)
