"""Event-loop lag: how late a 5 ms sleep wakes up, sampled while something else runs."""

from __future__ import annotations

import asyncio
import time


class LagMeter:
    """Event-loop lag: how late a 5 ms sleep wakes up, sampled while a push runs."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(0.005)
            self.samples.append(time.perf_counter() - t0 - 0.005)

    def start(self) -> None:
        self._task = asyncio.create_task(self._tick())

    async def stop(self) -> float:
        self._stop.set()
        if self._task is not None:
            await self._task
        s = sorted(self.samples)
        return s[int(len(s) * 0.99)] * 1e3 if s else 0.0


# baselines: blocking broadcasts --------------------------------------------------------------------
