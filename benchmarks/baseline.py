"""The trainer's side of the blocking baselines: rank 0 of a standalone gloo group that pushes
a state dict the way RL loops do today, with generators in ``benchmarks.workers`` processes."""

from __future__ import annotations

import asyncio
import datetime as dt
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.procs import Launch, Workers
from weightsync.bench.model import packed_chunks


def group(store: Any, rank: int, world: int, own: str | None) -> Any:
    """The baselines' gloo group; with ``own``, bound to that address (one connection per pair,
    as users get by default)."""
    prefixed = dist.PrefixStore("baseline", store)
    if own is None:
        return dist.ProcessGroupGloo(prefixed, rank, world, dt.timedelta(seconds=300))
    gloo: Any = dist.ProcessGroupGloo
    options = gloo._Options()
    options._devices = [gloo.create_device(hostname=own)]
    options._timeout = dt.timedelta(seconds=300)
    return gloo(prefixed, rank, world, options)


class BlockingBroadcast:
    """Spawns ``n`` receivers that follow ``plan`` [(mode, nominal MiB, pushes)], then pushes.

    ``plan`` holds *nominal* sizes: both sides build their state dict with
    ``make_state_dict(mib)`` from the same number, so the layouts match.
    """

    def __init__(self, n: int, plan: list[tuple[str, int, int]], packed_bytes: int, tmp: Path,
                 host: str = "127.0.0.1", hosts: list[str] | None = None, launch: Launch | None = None,
                 gate: bool = False) -> None:
        """``hosts`` and ``launch``: receivers on emulated hosts (rank r at ``hosts[r - 1]``),
        reaching this trainer at ``host``; each end's gloo binds its own address. ``gate``: the
        receivers build each size's model only once :meth:`begin` says so, and exit only after
        ``begin("end")`` (``workers.gate``)."""
        self.n = n
        self.packed_bytes = packed_bytes
        self.host = host if hosts else None
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                   timeout=dt.timedelta(seconds=300))
        self.workers = Workers(tmp, launch)
        for rank in range(1, n + 1):
            self.workers.spawn(role="baseline", host=host, port=self.store.port, rank=rank, world=n + 1,
                               plan=plan, packed_bytes=packed_bytes, own=hosts[rank - 1] if hosts else None,
                               gate=gate)
        self._bufs: list[torch.Tensor] = []
        self._pg: Any = None
        self._opts = dist.BroadcastOptions()
        self._opts.rootRank, self._opts.rootTensor = 0, 0

    async def connect(self) -> None:
        self._pg = await asyncio.get_running_loop().run_in_executor(None, lambda: group(self.store, 0, self.n + 1,
                                                                                         self.host))

    def push(self, sd: dict[str, torch.Tensor], mode: str) -> None:
        """Blocking, on the caller's thread (the event loop): exactly what users do today."""
        if mode == "naive":
            for t in sd.values():
                self._pg.broadcast([t], self._opts).wait()
            return
        if not self._bufs:
            self._bufs = [torch.empty(self.packed_bytes, dtype=torch.uint8) for _ in range(2)]
        work = None
        for i, chunk in enumerate(packed_chunks(sd, self.packed_bytes)):
            buf = self._bufs[i % 2][: chunk.nbytes]
            chunk.pack(buf)  # packing bucket i overlaps bucket i-1 on the wire
            if work is not None:
                work.wait()
            work = self._pg.broadcast([buf], self._opts)
        if work is not None:
            work.wait()

    async def wait_unpacked(self, mode: str, mib: int, rep: int) -> None:
        """Until every receiver has unpacked push ``rep``: each sets its own key, and the store's own
        wait runs on a thread, as weightsync's to-all is waited for (no polling while generators
        still receive; before 2026-12-03 this polled a counter every 0.5 ms)."""
        keys = [f"done/{mode}/{mib}/{rep}/{rank}" for rank in range(1, self.n + 1)]
        await asyncio.to_thread(self.store.wait, keys, dt.timedelta(seconds=600))

    def begin(self, key: str) -> None:
        """Tell gated receivers that the pushes of size ``key`` (nominal MiB) begin, or ``"end"``."""
        self.store.set(f"begin/{key}", b"1")

    def close(self, timeout: float = 600) -> list[dict]:
        try:
            return self.workers.results(timeout=timeout)
        finally:
            self.workers.kill()
