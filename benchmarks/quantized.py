"""Quantized versions against bf16 ones, side by side in one run, on a trained Llama (issue 56).

    python -m benchmarks.quantized [--layers 4] [--hidden 1024] [--vocab 8000] [--steps 3]
                                   [--formats fp8-block,int8-channel] [--planes group,group@1000]
                                   [--out benchmarks/results]

A Hugging Face Llama (random init, built here) with fp32 masters is trained with AdamW (lr 1e-6)
on random tokens, once per kind of version (the same seed: the same weights at each step). After
every step it is put to 2 generator processes (``benchmarks.delta``'s: each reads the version
and answers with its tensors' digests) as the engine would be sent it: bf16
(``dtype=torch.bfloat16``, full); for each format quantized and full (``quantize=FORMAT,
encoding="full"``); quantized as a delta against the step before's quantized version
(``encoding="delta"``). Planes: the group on this host (``group``: gloo over loopback)
and generators on emulated hosts behind R Mbit/s links (``group@R``: network namespaces, needs
root). Per version: bytes (the version's and on the wire), the trainer's stall (``put`` until it
returned: the quantization is in it), the time until both generators had it, and whether both
hold exactly what ``ws.quantize`` makes of the same parameters.

Also, once per format: the quantization of the whole model (``ws.quantize``) against its
ceiling measured in the same minute, one copy of the bf16 weights (``torch.clone`` of each).

Targets (issue 56): the quantized version's linear weights with their scales at most 0.51x their
bf16 bytes (the whole version's ratio is printed too: embeddings, head and norms stay bf16);
every version exact on both generators. Writes ``quantized.json`` and ``quantized.png``; exits 1
when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import torch

import weightsync as ws
from benchmarks import netns
from benchmarks.delta import Generator, fingerprint
from benchmarks.report import cpu_name, pyplot, verdict, write_json


class Push(msgspec.Struct):
    plane: str
    step: int
    version: int
    kind: str  # "bf16", "FORMAT full", "FORMAT delta"
    got: str  # what the generators got ("full" or "delta")
    nbytes: int
    wire_bytes: int  # for both generators
    stall_ms: float
    to_both_ms: float
    exact: bool


class Quantization(msgspec.Struct):
    format: str
    seconds: float  # ws.quantize of the whole model (bf16 in, on this host)
    copy_seconds: float  # one clone of the bf16 weights, the same minute
    linear_ratio: float  # quantized linear weights and their scales / their bf16 bytes
    version_ratio: float  # the whole quantized version / the whole bf16 version


class Report(msgspec.Struct):
    when: str
    torch: str
    cpu: str
    cores: int
    params: int
    bf16_bytes: int
    quantization: list[Quantization]
    pushes: list[Push]
    targets: dict[str, bool]


def measure_quantization(named: list[tuple[str, torch.nn.Parameter]], fmt: str) -> Quantization:
    bf16 = [(n, p.detach().to(torch.bfloat16)) for n, p in named]
    best_q = best_c = float("inf")
    for _ in range(3):  # alternated, the best of three each: the same minute's ceiling
        t0 = time.perf_counter()
        out = ws.quantize(bf16, fmt)
        best_q = min(best_q, time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _n, t in bf16:
            t.clone()
        best_c = min(best_c, time.perf_counter() - t0)
    quantized = {n.removesuffix(".weight") for n, t in out.items() if t.dtype.itemsize == 1}
    linear_bf16 = sum(t.numel() * 2 for n, t in bf16 if n.removesuffix(".weight") in quantized)
    made = (".weight", ".weight_scale", ".weight_scale_inv")
    linear_q = sum(t.numel() * t.element_size() for n, t in out.items()
                   if n.endswith(made) and n.rsplit(".", 1)[0] in quantized)
    whole_bf16 = sum(t.numel() * 2 for _n, t in bf16)
    whole_q = sum(t.numel() * t.element_size() for t in out.values())
    return Quantization(fmt, best_q, best_c, linear_q / linear_bf16, whole_q / whole_bf16)


async def run(plane: str, args: argparse.Namespace, config: Any, progress: Any) -> list[Push]:
    transport, _, rate = plane.partition("@")
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(netns.Cluster([float(rate)] * 2)) if rate else None
        address = f"{cluster.trainer_ip}:0" if cluster is not None else None
        return await _pushes(plane, transport, address, cluster, args, config, progress)


async def _pushes(plane: str, transport: str, address: str | None, cluster: Any, args: argparse.Namespace,
                  config: Any, progress: Any) -> list[Push]:
    """One series per kind, each the same training run (the same seed): a delta is against the
    same kind's version of the step before."""
    from transformers import LlamaForCausalLM

    pushes: list[Push] = []
    channel = f"quant-{transport}"
    kinds = [("bf16", None, "full")] + [(f"{f} {e}", f, e) for f in args.formats for e in ("full", "delta")]
    async with ws.Publisher(channel, address=address, timeout=120, bucket_bytes=64 << 20) as pub:
        gens = [Generator(channel, pub.address, f"gen{i}", transport, cluster, i) for i in range(2)]
        try:
            await pub.wait_subscribers(2, timeout=300)
            version = 0
            for kind, fmt, encoding in kinds:
                torch.manual_seed(0)
                model = LlamaForCausalLM(config)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-6, foreach=False)
                named = list(model.named_parameters())
                # the series' first version: the base of its first delta, and every buffer written once
                await (await pub.put(named, version=version, dtype=torch.bfloat16, quantize=fmt, encoding="full"))
                for g in gens:
                    await g.answer(version)
                version += 1
                for step in range(1, args.steps + 1):
                    tokens = torch.randint(0, config.vocab_size, (1, 64))
                    model(input_ids=tokens, labels=tokens).loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    t0 = time.perf_counter()
                    handle = await pub.put(named, version=version, dtype=torch.bfloat16, quantize=fmt,
                                           encoding=encoding)
                    stall = time.perf_counter() - t0
                    report = await handle.delivered(timeout=600)
                    to_both = time.perf_counter() - t0
                    answers = [await g.answer(version) for g in gens]
                    sent = [(n, p.detach().to(torch.bfloat16)) for n, p in named]
                    expected = fingerprint(sent if fmt is None else ws.quantize(sent, fmt).items())
                    push = Push(plane, step, version, kind, "+".join(sorted(set(report.encodings.values()))),
                                report.nbytes, report.wire_bytes, stall * 1e3, to_both * 1e3,
                                len(report.members) == 2 and all(a["fingerprint"] == expected for a in answers))
                    pushes.append(push)
                    progress(push)
                    version += 1
                del model, opt, named
        finally:
            for g in gens:
                g.kill()
    return pushes


def check_targets(quantization: list[Quantization], pushes: list[Push]) -> dict[str, bool]:
    targets = {"every version exact on both generators": bool(pushes) and all(p.exact for p in pushes)}
    for q in quantization:
        targets[f"{q.format}: linear weights and scales <= 0.51x their bf16 bytes"] = q.linear_ratio <= 0.51
    return targets


def table(pushes: list[Push]) -> str:
    head = ("| plane | kind | got | bytes / bf16 | wire / bf16's | stall ms | to both ms | exact |\n"
            + "| --- " * 8 + "|")
    rows = []
    for plane in dict.fromkeys(p.plane for p in pushes):
        mine = [p for p in pushes if p.plane == plane]
        base = {p.step: p for p in mine if p.kind == "bf16"}
        for kind in dict.fromkeys(p.kind for p in mine):
            of = [p for p in mine if p.kind == kind]
            rows.append(f"| {plane} | {kind} | {'+'.join(sorted({p.got for p in of}))} "
                        f"| {statistics.median(p.nbytes / base[p.step].nbytes for p in of):.3f} "
                        f"| {statistics.median(p.wire_bytes / base[p.step].wire_bytes for p in of):.3f} "
                        f"| {statistics.median(p.stall_ms for p in of):.0f} "
                        f"| {statistics.median(p.to_both_ms for p in of):.0f} "
                        f"| {'yes' if all(p.exact for p in of) else 'NO'} |")
    return "\n".join([head, *rows])


def plot(report: Report, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    planes = list(dict.fromkeys(p.plane for p in report.pushes))
    kinds = list(dict.fromkeys(p.kind for p in report.pushes))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.8 / max(len(planes), 1)
    for i, plane in enumerate(planes):
        mine = [p for p in report.pushes if p.plane == plane]
        xs = [k + i * width for k in range(len(kinds))]
        axes[0].bar(xs, [statistics.median(p.wire_bytes for p in mine if p.kind == k) / 2**20 for k in kinds],
                    width, label=plane)
        axes[1].bar(xs, [statistics.median(p.to_both_ms for p in mine if p.kind == k) for k in kinds], width,
                    label=plane)
    for ax, label in zip(axes, ("wire MiB (both generators), median", "ms until both generators had it, median"),
                         strict=True):
        ax.set_xticks([k + width * (len(planes) - 1) / 2 for k in range(len(kinds))], kinds, rotation=20, fontsize=8)
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    fig.suptitle(f"quantized versions, {report.params / 1e6:.0f}M-parameter Llama, 2 generators, {report.cpu}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--formats", default="fp8-block,int8-channel")
    parser.add_argument("--planes", default="group,group@1000",
                        help="group (this host), group@MBIT (emulated remote hosts, needs root)")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    args.formats = args.formats.split(",")
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as err:
        raise SystemExit(f"benchmarks.quantized needs transformers (make env-vllm has it): {err}") from None
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                         num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=16,
                         max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    named = list(LlamaForCausalLM(config).named_parameters())
    quantization = [measure_quantization(named, f) for f in args.formats]
    for q in quantization:
        print(f"{q.format}: quantize {q.seconds * 1e3:.0f} ms against a bf16 copy's {q.copy_seconds * 1e3:.0f} ms "
              f"({q.copy_seconds / q.seconds:.2f}x the copy's rate); linear weights {q.linear_ratio:.4f}x bf16, "
              f"the whole version {q.version_ratio:.3f}x", flush=True)
    params, bf16 = sum(p.numel() for _n, p in named), sum(p.numel() * 2 for _n, p in named)
    del named

    def progress(p: Push) -> None:
        print(f"{p.plane:10} step {p.step} {p.kind:20} -> {p.got:6} {p.nbytes / 2**20:7.1f} MiB wire "
              f"{p.wire_bytes / 2**20:7.1f} MiB stall {p.stall_ms:6.0f} ms to both {p.to_both_ms:6.0f} ms "
              f"exact {p.exact}", flush=True)

    pushes: list[Push] = []
    for plane in args.planes.split(","):
        if "@" in plane and netns.unavailable():
            print(f"{plane}: skipped ({netns.unavailable()})")
            continue
        pushes += asyncio.run(run(plane, args, config, progress))
    report = Report(time.strftime("%Y-%m-%d %H:%M"), str(torch.__version__), cpu_name(), os.cpu_count() or 0,
                    params, bf16, quantization, pushes, check_targets(quantization, pushes))
    print(table(pushes))
    path = write_json(args.out, "quantized", report)
    plot(report, Path(args.out) / "quantized.png")
    print(f"wrote {path}")
    return verdict(report.targets)


if __name__ == "__main__":
    raise SystemExit(main())
