"""Delta versions against full ones, side by side in one run, on a trained Llama (issue 23).

    python -m benchmarks.delta [--layers 8] [--hidden 2048] [--lrs 1e-6,3e-6,1e-4] [--steps 3]
                               [--planes group,group@1000,shm] [--no-overlap] [--copy-false]
                               [--out benchmarks/results]

A Hugging Face Llama (random init, built here: no download; the defaults make about 1 GiB of
bf16) with fp32 master weights is trained with AdamW on random tokens. After every step its
parameters are put twice, as the engine serves them (``put(dtype=torch.bfloat16)``: the cast is
the snapshot's copy): once with ``encoding="auto"`` (a delta against the previous step) and then
with ``encoding="full"``, the same bytes, to 2 generator processes: over the group on this host
(``group``: gloo over loopback), over the group to generators on emulated other hosts behind
links of R Mbit/s each (``group@R``: network namespaces, benchmarks/netns.py, needs root), and
over shared memory (``shm``). The last step of each learning rate puts a bf16 copy the
caller made instead (the same bytes: ``dtype=`` against a copy the trainer pays for itself).
``--copy-false`` puts every version with ``copy=False`` instead (the first warm-up put asks for
``"delta"``, so the publisher keeps a copy of what it sends: the base of the ``"auto"`` puts),
and no caller's copy.

Per version: the share of bf16 elements that changed (counted here, bit for bit), wire bytes
against full, bytes per changed element, the sender's encode time, the trainer's stall (``put``
until it returned), the time until both generators acknowledged (``put`` until its report), the
generators' receive time (Announce to readable: decoding and checking included), and whether
each generator's bytes are the trainer's (each reads the version and sends back its tensors'
CRC32C digests; the bench waits for both before the next put, so no check overlaps a push).

After the table, where each delta's time went: the encode, the wire at the link's rate, the
slower generator's decode and verify, each beside its ceiling measured in the same run on one
thread (the compare pass: one XOR over both versions; a copy of the version), and the time to
both against the physical limit (compare pass + copy + wire); the plot's third panel stacks them.

Targets on the 2-core development machine (issue 23), for remote generators (the first
``group@R`` plane): at lr 1e-6, wire bytes at most 5 % of full, at most 2.5 bytes per changed
element, time to both at most 0.25x full; at lr 1e-4, on every group plane, ``auto`` at most
1.05x full (median); the stall with ``auto`` at most 1.2x with ``full`` (median); every version
bit-exact on every generator. On this host's loopback a full version is faster than a CPU delta
(docs/deltas.md says why), and ``auto`` measures that and sends full. Writes ``delta.json`` and
``delta.png`` (``delta_copy_false.*``); exits 1 when a target is missed. Needs ``transformers``
(the vLLM environment has it: ``make bench-delta``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

import weightsync as ws
from benchmarks import netns
from benchmarks.report import cpu_name, pyplot, verdict, write_json
from weightsync.testing import digest


class Push(msgspec.Struct):
    transport: str
    lr: float
    step: int
    version: int
    encoding: str  # what was asked: "auto" or "full"
    got: str  # what the generators got ("delta" or "full")
    caller_copy: bool  # the caller made the bf16 copy (else put(dtype=) cast it)
    changed: float  # share of bf16 elements whose bits changed since the previous step
    nbytes: int
    wire_bytes: int  # for both generators
    bytes_per_changed: float
    encode_ms: float
    stall_ms: float
    to_both_ms: float
    receive_ms: list[float]  # per generator: Announce to readable
    exact: bool
    decode_ms: list[float] = []  # per generator: of receive_ms, rebuilding buckets from the delta
    verify_ms: list[float] = []  # per generator: of receive_ms, taking the buckets' digests
    link_ms: float = 0.0  # the wire's ceiling: one generator's wire bytes at the link's rate (0: loopback)


class Ceilings(msgspec.Struct):
    """Measured in the same run, one thread, over the version's bf16 bytes: what an encode must at
    least do (one pass over both versions) and what a decode must at least do (write it once)."""

    copy_ms: float
    compare_ms: float


class Report(msgspec.Struct):
    when: str
    torch: str
    cpu: str
    cores: int
    params: int
    bf16_bytes: int
    pushes: list[Push]
    targets: dict[str, bool]
    ceilings: Ceilings | None = None


def fingerprint(items: Any) -> str:
    """What a generator sends back for a version: its tensors' digests, in name order."""
    sums = {}
    for name, tensor in items:  # one at a time: a generator of casts holds one copy at once
        sums[name] = digest(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
    h = hashlib.sha256()
    for name in sorted(sums):
        h.update(name.encode() + sums[name].to_bytes(8, "little"))
    return h.hexdigest()[:24]


class Generator:
    """A generator process: reads every version and answers with its fingerprint (one JSON line)."""

    def __init__(self, channel: str, address: str, member: str, transport: str, cluster: Any = None,
                 host: int = 0) -> None:
        spec = {"channel": channel, "address": address, "member": member, "transport": transport}
        argv = [sys.executable, "-m", "benchmarks.delta", "--generator", msgspec.json.encode(spec).decode()]
        env = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR")
        self.proc = (subprocess.Popen(argv, stdout=subprocess.PIPE, env=env) if cluster is None
                     else cluster.popen(host, argv, env=env, stdout=subprocess.PIPE))

    async def answer(self, version: int, timeout: float = 600) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout)
            if not line:
                raise RuntimeError(f"a generator exited ({self.proc.poll()}) before version {version}")
            got = msgspec.json.decode(line)
            if got.get("error"):
                raise RuntimeError(f"a generator failed: {got['error']}")
            if got["version"] >= version:
                return got

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


async def generator_main(spec: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    out = sys.stdout
    try:
        async with ws.Subscriber(spec["channel"], address=spec["address"], member_id=spec["member"],
                                 timeout=120, transport=spec["transport"]) as sub:
            last, before = -1, (0.0, 0.0, 0.0)
            while True:
                async with sub.stream(min_version=last + 1, timeout=3600) as weights:
                    print_ = await asyncio.to_thread(fingerprint, list(weights))
                    last = weights.version
                stats = sub.statistics()
                now = (stats.receive.total, stats.decode_seconds, stats.verify_seconds)
                took = [(b - a) * 1e3 for a, b in zip(before, now, strict=True)]
                out.write(msgspec.json.encode({"version": last, "fingerprint": print_, "receive_ms": took[0],
                                               "decode_ms": took[1], "verify_ms": took[2]}).decode() + "\n")
                out.flush()
                before = now
    except (ws.PublisherGone, ws.Closed, ws.Evicted):
        return
    except Exception as err:  # noqa: BLE001 - reported to the bench, which fails loudly
        out.write(msgspec.json.encode({"version": -1, "error": f"{type(err).__name__}: {err}"}).decode() + "\n")
        out.flush()


def bf16_bits(model: Any) -> list[torch.Tensor]:
    return [p.detach().to(torch.bfloat16).view(torch.int16).reshape(-1) for p in model.parameters()]


def count_changed(model: Any, prev: list[torch.Tensor]) -> tuple[int, int]:
    """Elements whose bf16 bits changed since ``prev`` (updated in place), and all elements: one
    parameter at a time, so the bench holds one bf16 copy of the model, not two."""
    changed = total = 0
    for i, p in enumerate(model.parameters()):
        cur = p.detach().to(torch.bfloat16).view(torch.int16).reshape(-1)
        changed += int(torch.count_nonzero(cur != prev[i]))
        total += cur.numel()
        prev[i] = cur
    return changed, total


async def run(plane: str, args: argparse.Namespace, config: Any, progress: Any) -> list[Push]:
    from transformers import LlamaForCausalLM

    transport, _, rate = plane.partition("@")
    channel = f"delta-{transport}"
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(netns.Cluster([float(rate)] * 2)) if rate else None
        address = f"{cluster.trainer_ip}:0" if cluster is not None else None
        return await _pushes(plane, transport, channel, address, cluster, args, config, progress, LlamaForCausalLM,
                             rate)


async def _pushes(plane: str, transport: str, channel: str, address: str | None, cluster: Any,
                  args: argparse.Namespace, config: Any, progress: Any, model_class: Any, rate: str = ""
                  ) -> list[Push]:
    pushes: list[Push] = []
    async with ws.Publisher(channel, address=address, timeout=120, bucket_bytes=64 << 20) as pub:
        gens = [Generator(channel, pub.address, f"gen{i}", transport, cluster, i) for i in range(2)]
        try:
            await pub.wait_subscribers(2, timeout=300)
            version = 0
            for lr in args.lrs:
                torch.manual_seed(0)
                model = model_class(config)
                opt = torch.optim.AdamW(model.parameters(), lr=lr, foreach=False)
                prev = bf16_bits(model)
                named = list(model.named_parameters())
                # the first base; on a new channel three times, so every buffer a steady state uses has
                # been written once (the generators' two slots, the publisher's pending, in-flight and
                # base snapshots) and no timed push pays for first touching a buffer's pages
                for warm in range(3 if version == 0 else 1):
                    # --copy-false: the first one asks for a delta (it goes full: no base yet), so the
                    # publisher keeps a copy of what it sends from then on; the full ones refresh it
                    first = "delta" if args.copy_false and warm == 0 else "full"
                    await (await pub.put(named, version=version, dtype=torch.bfloat16, encoding=first,
                                         copy=not args.copy_false))
                    for sub in gens:
                        await sub.answer(version)
                    version += 1
                for step in range(1, args.steps + 1):
                    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq))
                    model(input_ids=tokens, labels=tokens).loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    caller_copy = step == args.steps
                    # both puts follow the same work (the training step, the one before's delivery);
                    # what they are checked against is computed after both (the parameters stay put)
                    done: list[tuple[str, bool, float, float, Any, list[dict[str, Any]]]] = []
                    for encoding in ("auto", "full"):
                        own = caller_copy and encoding == "auto" and not args.copy_false
                        t0 = time.perf_counter()
                        if own:  # the trainer makes the bf16 copy itself, then puts it
                            handle = await pub.put([(n, p.detach().to(torch.bfloat16)) for n, p in named],
                                                   version=version, encoding=encoding)
                        else:  # copy=False: cast as each bucket is packed, from the live parameters
                            handle = await pub.put(named, version=version, dtype=torch.bfloat16, encoding=encoding,
                                                   copy=not args.copy_false)
                        stall = time.perf_counter() - t0
                        report = await handle.delivered(timeout=600)
                        to_both = time.perf_counter() - t0
                        if len(report.members) != 2:
                            raise RuntimeError(f"version {version} reached {report.members} only")
                        done.append((encoding, own, stall, to_both, report, [await g.answer(version) for g in gens]))
                        version += 1
                    changed, total = count_changed(model, prev)
                    expected = fingerprint((n, p.detach().to(torch.bfloat16)) for n, p in named)
                    for encoding, own, stall, to_both, report, answers in done:
                        got = sorted(set(report.encodings.values()))
                        push = Push(plane, lr, step, report.version, encoding, "+".join(got), own, changed / total,
                                    report.nbytes, report.wire_bytes, report.wire_bytes / 2 / max(changed, 1),
                                    report.encode_seconds * 1e3, stall * 1e3, to_both * 1e3,
                                    [a["receive_ms"] for a in answers],
                                    all(a["fingerprint"] == expected and a["version"] == report.version
                                        for a in answers),
                                    [a["decode_ms"] for a in answers], [a["verify_ms"] for a in answers],
                                    report.wire_bytes / 2 * 8 / (float(rate) * 1e6) * 1e3 if rate else 0.0)
                        pushes.append(push)
                        progress(push)
                del model, opt, named, prev
        finally:
            for g in gens:
                g.kill()
    return pushes


def check_targets(pushes: list[Push]) -> dict[str, bool]:
    def pairs(transport: str, lr: float) -> list[tuple[Push, Push]]:
        """auto against full of the same step; not the step whose auto put was of the caller's own
        bf16 copy (its stall and time include making that copy: a comparison of its own)."""
        auto = [p for p in pushes if (p.transport, p.lr) == (transport, lr) and p.encoding != "full"
                and not p.caller_copy]
        full = {p.step: p for p in pushes if (p.transport, p.lr, p.encoding) == (transport, lr, "full")}
        return [(a, full[a.step]) for a in auto if a.step in full]

    targets: dict[str, bool] = {"every version bit-exact on every generator": all(p.exact for p in pushes)}
    planes = list(dict.fromkeys(p.transport for p in pushes))
    remote = next((p for p in planes if p.startswith("group@")), None)
    low = pairs(remote, 1e-6) if remote else []
    if low:
        targets[f"{remote}, lr 1e-6: wire bytes <= 5% of full"] = \
            all(a.wire_bytes <= 0.05 * f.wire_bytes for a, f in low)
        targets[f"{remote}, lr 1e-6: <= 2.5 bytes per changed element"] = \
            statistics.mean(a.bytes_per_changed for a, _ in low) <= 2.5
        targets[f"{remote}, lr 1e-6: time to both <= 0.25x full"] = \
            all(a.to_both_ms <= 0.25 * f.to_both_ms for a, f in low)
    for plane in (p for p in planes if p.startswith("group")):
        high = pairs(plane, 1e-4)
        if high:
            targets[f"{plane}, lr 1e-4: auto <= 1.05x full"] = \
                statistics.median(a.to_both_ms / f.to_both_ms for a, f in high) <= 1.05
    every = [pair for plane in planes for lr in {p.lr for p in pushes} for pair in pairs(plane, lr)]
    if every:
        targets["stall with auto <= 1.2x with full"] = \
            statistics.median(a.stall_ms / f.stall_ms for a, f in every) <= 1.2
    return targets


def measure_ceilings(nbytes: int, reps: int = 3) -> Ceilings:
    """A copy of ``nbytes`` and one XOR pass over two buffers of it, a cache-sized slice at a time
    (numpy, as the codec), one thread, best of ``reps``."""
    import numpy as np

    torch.set_num_threads(1)
    cur, base = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    out = torch.empty_like(cur)
    c, b = cur[: nbytes // 8 * 8].numpy().view(np.int64), base[: nbytes // 8 * 8].numpy().view(np.int64)
    scratch = np.empty(1 << 15, np.int64)

    def compare() -> None:
        for lo in range(0, c.size, scratch.size):
            hi = min(lo + scratch.size, c.size)
            np.bitwise_xor(c[lo:hi], b[lo:hi], out=scratch[: hi - lo])

    def best(fn: Any) -> float:
        took = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            took.append(time.perf_counter() - t0)
        return min(took) * 1e3

    ceilings = Ceilings(copy_ms=best(lambda: out.copy_(cur)), compare_ms=best(compare))
    torch.set_num_threads(os.cpu_count() or 1)
    return ceilings


def limit_ms(p: Push, ceilings: Ceilings) -> float:
    """The physical limit of one delta version here: one compare pass, one copy, its wire at the link."""
    return ceilings.compare_ms + ceilings.copy_ms + p.link_ms


def breakdown(pushes: list[Push], ceilings: Ceilings) -> str:
    """Where each delta's time went, beside its ceilings (one thread each; the generator's figures
    are the slower one's)."""
    head = ("| plane | lr | step | encode ms (compare pass) | wire ms at the link | decode ms (copy) | verify ms | "
            "to both ms | / physical limit |\n" + "| --- " * 9 + "|")
    rows = []
    for p in pushes:
        if p.got != "delta" or not p.decode_ms:
            continue
        rows.append(f"| {p.transport} | {p.lr:g} | {p.step} | {p.encode_ms:.0f} ({ceilings.compare_ms:.0f}) | "
                    f"{p.link_ms:.0f} | {max(p.decode_ms):.0f} ({ceilings.copy_ms:.0f}) | {max(p.verify_ms):.0f} | "
                    f"{p.to_both_ms:.0f} | {p.to_both_ms / limit_ms(p, ceilings):.1f}x |")
    return "\n".join([head, *rows])


def table(pushes: list[Push]) -> str:
    head = ("| plane | lr | step | asked | got | changed | wire / full | B per changed | encode ms | stall ms | "
            "to both ms | receive ms | exact |\n" + "| --- " * 13 + "|")
    rows = []
    for p in pushes:
        rows.append(f"| {p.transport} | {p.lr:g} | {p.step} | {p.encoding}{' (own copy)' if p.caller_copy else ''} "
                    f"| {p.got} | {p.changed:.2%} | {p.wire_bytes / (2 * p.nbytes):.3f} | "
                    f"{p.bytes_per_changed:.2f} | {p.encode_ms:.0f} | {p.stall_ms:.0f} | {p.to_both_ms:.0f} | "
                    f"{max(p.receive_ms):.0f} | {'yes' if p.exact else 'NO'} |")
    return "\n".join([head, *rows])


def plot(report: Report, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    for transport, marker in zip(dict.fromkeys(p.transport for p in report.pushes), "os^v", strict=False):
        for lr in sorted({p.lr for p in report.pushes}):
            auto = [p for p in report.pushes if (p.transport, p.lr) == (transport, lr) and p.encoding != "full"]
            full = {p.step: p for p in report.pushes if (p.transport, p.lr, p.encoding) == (transport, lr, "full")}
            if not auto:
                continue
            label = f"{transport}, lr {lr:g}"
            axes[0].plot([a.step for a in auto], [a.wire_bytes / (2 * a.nbytes) for a in auto], marker, ls="-",
                         label=label)
            axes[1].plot([a.step for a in auto if a.step in full],
                         [a.to_both_ms / full[a.step].to_both_ms for a in auto if a.step in full], marker, ls="-",
                         label=label)
    axes[0].set_yscale("log")
    axes[0].set_ylabel("wire bytes / full")
    axes[0].axhline(0.05, color="grey", ls="--", lw=0.8)
    axes[1].set_ylabel("time to both generators: auto / full")
    axes[1].axhline(1.0, color="grey", ls="--", lw=0.8)
    axes[1].axhline(0.25, color="grey", ls=":", lw=0.8)
    for ax in axes[:2]:
        ax.set_xticks(sorted({p.step for p in report.pushes}))
        ax.set_xlabel("training step")
        ax.legend(fontsize=7)
    deltas = [p for p in report.pushes if p.got == "delta" and p.decode_ms]
    if deltas and report.ceilings is not None:  # where each delta's time went, stacked, against its limit
        ax = axes[2]
        x = list(range(len(deltas)))
        parts = [("encode", [p.encode_ms for p in deltas]), ("wire at the link", [p.link_ms for p in deltas]),
                 ("decode", [max(p.decode_ms) for p in deltas]), ("verify", [max(p.verify_ms) for p in deltas])]
        bottom = [0.0] * len(deltas)
        for name, values in parts:
            ax.bar(x, values, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
        ax.plot(x, [p.to_both_ms for p in deltas], "k_", markersize=18, mew=2, label="to both (pipelined)")
        ax.plot(x, [limit_ms(p, report.ceilings) for p in deltas], "r_", markersize=18, mew=2,
                label="physical limit (compare + copy + link)")
        ax.set_xticks(x, [f"{p.transport}\n{p.lr:g} s{p.step}" for p in deltas], fontsize=6)
        ax.set_ylabel("ms (one thread each; generator: the slower one)")
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3)
    fig.suptitle(f"deltas, {report.params / 1e6:.0f}M-parameter Llama ({report.bf16_bytes / 2**30:.2f} GiB bf16), "
                 f"2 generators, {report.cores} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--generator"]:
        import uvloop

        uvloop.run(generator_main(msgspec.json.decode(argv[1])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--lrs", default="1e-6,3e-6,1e-4")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--planes", default="group,group@1000,shm",
                        help="group (this host), group@MBIT (emulated remote hosts, needs root), shm")
    parser.add_argument("--no-overlap", action="store_true",
                        help="make each delta whole before its first bucket goes (planes.delta.OVERLAP = False)")
    parser.add_argument("--copy-false", action="store_true",
                        help='every put copy=False: "auto" against the publisher\'s kept copy, beside "full"')
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(argv)
    args.lrs = [float(x) for x in args.lrs.split(",")]
    if args.no_overlap:
        from weightsync.encodings import delta as delta_plane

        delta_plane.OVERLAP = False
    try:
        from transformers import LlamaConfig
    except ImportError as err:
        raise SystemExit(f"benchmarks.delta needs transformers (make bench-delta): {err}") from None
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=16,
                         max_position_embeddings=512, tie_word_embeddings=False)
    pushes: list[Push] = []
    params = 0

    def progress(p: Push) -> None:
        print(f"{p.transport:5} lr {p.lr:g} step {p.step} {p.encoding:4}{'*' if p.caller_copy else ' '} -> "
              f"{p.got:10} changed {p.changed:6.2%} wire/full {p.wire_bytes / (2 * p.nbytes):.4f} "
              f"({p.bytes_per_changed:.2f} B/changed) encode {p.encode_ms:5.0f} ms stall {p.stall_ms:5.0f} ms "
              f"to both {p.to_both_ms:6.0f} ms receive {max(p.receive_ms):5.0f} ms exact {p.exact}", flush=True)

    for plane in args.planes.split(","):  # shm where it is not available: the generators say so
        if "@" in plane and netns.unavailable():
            print(f"{plane}: skipped ({netns.unavailable()})")
            continue
        pushes += asyncio.run(run(plane, args, config, progress))
    if pushes:
        params = pushes[0].nbytes // 2
    ceilings = measure_ceilings(pushes[0].nbytes) if pushes else None
    report = Report(time.strftime("%Y-%m-%d %H:%M"), str(torch.__version__), cpu_name(), os.cpu_count() or 0,
                    params, pushes[0].nbytes if pushes else 0, pushes, check_targets(pushes), ceilings)
    print(table(pushes))
    if ceilings is not None:
        print(f"\nwhere each delta's time went (ceilings here, one thread: compare pass {ceilings.compare_ms:.0f} ms, "
              f"copy {ceilings.copy_ms:.0f} ms)\n" + breakdown(pushes, ceilings))
    name = "delta_copy_false" if args.copy_false else "delta"
    path = write_json(args.out, name, report)
    plot(report, Path(args.out) / f"{name}.png")
    print(f"wrote {path}")
    return verdict(report.targets)


if __name__ == "__main__":
    raise SystemExit(main())
