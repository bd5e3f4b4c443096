"""Follow one version through the library, thread by thread: the modules its calls enter, in order.

    python scripts/trace_version.py

A publisher and one group subscriber in this process; after a warm-up version, one more is put
and read with a profiler on every thread. For each thread: how many modules, how many stops
(consecutive calls in one module are one stop) and how many stops return to a module already
left, then the stops. A coordinator (the Sender, the Receiver) calling its helpers counts as
returns; the data path (Sender > send side > part > plane > torch) reads in one direction.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any

import torch

import weightsync as ws

ON = [False]
SEQS: dict[str, list[str]] = {}


def _profile(frame: Any, event: str, arg: Any) -> None:
    if event == "call" and ON[0]:
        module = frame.f_globals.get("__name__", "")
        if module.startswith("weightsync"):
            SEQS.setdefault(threading.current_thread().name, []).append(module.removeprefix("weightsync."))


async def main() -> None:
    threading.setprofile(_profile)  # threads started from here on (the publisher's and subscriber's)
    async with ws.Publisher("trace", timeout=5.0, heartbeat_interval=0.25) as pub:  # noqa: SIM117 - needs its address
        async with ws.Subscriber("trace", address=pub.address, member_id="m", transport="group") as sub:
            await pub.wait_subscribers(1, timeout=20)
            state = {"w": torch.randn(1000, 100)}
            await (await pub.put(state, version=0))
            await sub.get(min_version=0, timeout=10)
            sys.setprofile(_profile)
            ON[0] = True
            await (await pub.put(state, version=1))
            await sub.get(min_version=1, timeout=10)
            ON[0] = False
            sys.setprofile(None)
    threading.setprofile(None)  # type: ignore[arg-type]
    for thread, seq in SEQS.items():
        stops = [s for i, s in enumerate(seq) if i == 0 or seq[i - 1] != s]
        left: set[str] = set()
        returns = 0
        for i, stop in enumerate(stops):
            returns += stop in left
            if i:
                left.add(stops[i - 1])
        print(f"{thread}: {len(set(stops))} modules, {len(stops)} stops, {returns} returns")
        print("   ", " > ".join(stops))


if __name__ == "__main__":
    asyncio.run(main())
