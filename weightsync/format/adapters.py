"""LoRA adapters as versions of a channel: what one adapter is, and how a set of them rides one version.

An adapter is a PEFT LoRA adapter's state: the ``lora_A`` (``rank x in``) and ``lora_B`` (``out x
rank``) factors of each target module, under the names ``peft.get_peft_model_state_dict`` gives
them (the names of an ``adapter_model.safetensors``), with its rank, alpha and target modules.

An adapter channel carries a *set*: each version of the channel holds the latest version of every
adapter the publisher has, each tensor under ``"<adapter>/<PEFT name>"``, and a manifest
(:class:`AdapterSet`, msgpack in a ``uint8`` tensor named :data:`MANIFEST`) saying which version of
which adapter, with what rank, alpha and targets, each version holds. So each adapter has versions
of its own and latest wins per adapter: a member that skips a version of the channel (a newer one
came first) still finds every adapter's newest version in what it reads, and with the delta
encoding the adapters that did not change cost almost no bytes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
import torch

from weightsync.format.layout import all_finite

#: the tensor of a version holding its :class:`AdapterSet`
MANIFEST = "__weightsync_adapters__"
#: adapter names: letters, digits and ``. _ : + = -`` (no ``/``: it separates the adapter from the
#: tensor name; no ``@``: ``name@version`` names one version)
ADAPTER_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:+=-]{0,127}")
_FACTOR = re.compile(r"(.+)\.lora_([AB])\.weight")


class AdapterEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One adapter's version in a version of the channel."""

    name: str
    version: int
    rank: int
    alpha: float
    target_modules: list[str]
    tensors: list[str]  # its PEFT names, in the order sent
    use_rslora: bool = False

    def peft_config(self) -> dict[str, Any]:
        """What an ``adapter_config.json`` of this adapter says (the fields an engine reads)."""
        return {"peft_type": "LORA", "r": self.rank, "lora_alpha": self.alpha, "target_modules": self.target_modules,
                "use_rslora": self.use_rslora, "bias": "none", "modules_to_save": None, "use_dora": False}

    @property
    def scaling(self) -> float:
        """What the factors' product is multiplied by: alpha / rank (alpha / sqrt(rank) with rsLoRA)."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


class AdapterSet(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The manifest of a version of an adapter channel: every adapter it holds."""

    adapters: list[AdapterEntry]
    format: int = 1

    def entry(self, name: str) -> AdapterEntry | None:
        return next((a for a in self.adapters if a.name == name), None)


class Adapter:
    """A LoRA adapter to put: its factors and its configuration.

    ``tensors`` maps PEFT names (``...q_proj.lora_A.weight``, ``...q_proj.lora_B.weight``) to
    factors; plain tensors or, on a sharded trainer, ``DTensor``s. ``ValueError`` naming the problem
    for anything a LoRA engine could not serve: a factor without its pair, shapes that disagree
    with ``rank``, a tensor that is not a factor (embedding LoRA, ``modules_to_save``), a factor that
    is not floating-point or holds NaN or infinity, an alpha that is not a finite positive number.
    """

    def __init__(self, tensors: Mapping[str, torch.Tensor], *, rank: int, alpha: float,
                 target_modules: Iterable[str] | None = None, use_rslora: bool = False) -> None:
        if not isinstance(tensors, Mapping) or not tensors:
            raise ValueError("an adapter needs its factors: a non-empty mapping of PEFT names to tensors")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an int >= 1, got {rank!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
            raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
        self.tensors = dict(tensors)
        self.rank, self.alpha, self.use_rslora = rank, float(alpha), bool(use_rslora)
        modules = _check_factors(self.tensors, rank)
        found = sorted({m.rsplit(".", 1)[-1] for m in modules})
        self.target_modules = sorted(target_modules) if target_modules is not None else found
        missing = [m for m in found if m not in self.target_modules]
        if missing:
            raise ValueError(f"the adapter has factors of modules its target_modules do not name: {missing}")

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def entry(self, name: str, version: int) -> AdapterEntry:
        return AdapterEntry(name, version, self.rank, self.alpha, list(self.target_modules), list(self.tensors),
                            self.use_rslora)


def from_peft(model: torch.nn.Module, adapter_name: str = "default") -> Adapter:
    """The adapter ``adapter_name`` of a ``peft`` model (``PeftModel``, or a model with adapters
    injected), as ``peft.get_peft_model_state_dict`` and its ``LoraConfig`` give it: the names are
    those ``save_pretrained`` writes. Reads the model's own parameters (no copy: ``put`` copies).
    ``ValueError`` for what an adapter channel does not carry (DoRA, biases, ``modules_to_save``,
    per-module ranks or alphas)."""
    try:
        from peft import get_peft_model_state_dict
    except ImportError as err:  # pragma: no cover - peft is the caller's
        raise ImportError("weightsync.from_peft needs peft (pip install peft)") from err
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, Mapping) or adapter_name not in configs:
        raise ValueError(f"the model has no LoRA adapter named {adapter_name!r} "
                         f"(it has {sorted(configs) if isinstance(configs, Mapping) else 'none'})")
    config = configs[adapter_name]
    unsupported = {"use_dora": bool(getattr(config, "use_dora", False)),
                   "bias": getattr(config, "bias", "none") != "none",
                   "modules_to_save": bool(getattr(config, "modules_to_save", None)),
                   "rank_pattern": bool(getattr(config, "rank_pattern", None)),
                   "alpha_pattern": bool(getattr(config, "alpha_pattern", None))}
    bad = sorted(k for k, v in unsupported.items() if v)
    if bad:
        raise ValueError(f"adapter {adapter_name!r} uses {', '.join(bad)}: an adapter channel carries plain LoRA "
                         "factors only")
    state = get_peft_model_state_dict(model, adapter_name=adapter_name)
    targets = getattr(config, "target_modules", None)
    return Adapter(state, rank=int(config.r), alpha=float(config.lora_alpha),
                   target_modules=None if targets is None or isinstance(targets, str) else list(targets),
                   use_rslora=bool(getattr(config, "use_rslora", False)))


def check_name(name: object) -> str:
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
        raise ValueError(f"adapter names are 1-128 characters of letters, digits and . _ : + = - (starting with a "
                         f"letter, a digit or _), got {name!r}")
    return name


def _check_factors(tensors: dict[str, torch.Tensor], rank: int) -> set[str]:
    """The modules the factors adapt; ValueError for what is not a pair of factors of ``rank``."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        if not isinstance(key, str) or not isinstance(tensor, torch.Tensor):
            raise ValueError(f"an adapter maps PEFT names to tensors, got {key!r}: {type(tensor).__name__}")
        match = _FACTOR.fullmatch(key)
        if match is None:
            raise ValueError(f"{key!r} is not a LoRA factor (<module>.lora_A.weight or <module>.lora_B.weight): "
                             "an adapter channel carries the factors only")
        if not tensor.is_floating_point() or tensor.dim() != 2:
            raise ValueError(f"factor {key!r} must be a 2-D floating-point tensor, got {tensor.dtype} "
                             f"{tuple(tensor.shape)}")
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
        if not all_finite(local):
            raise ValueError(f"factor {key!r} holds NaN or infinity")
        pairs.setdefault(match.group(1), {})[match.group(2)] = tensor
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"module {module!r} has lora_{''.join(pair)} without lora_{'B' if 'A' in pair else 'A'}")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"module {module!r}: lora_A is {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                             f"expected ({rank}, in) and (out, {rank}) for rank {rank}")
    return set(pairs)


def encode_manifest(manifest: AdapterSet) -> torch.Tensor:
    return torch.frombuffer(bytearray(msgspec.msgpack.encode(manifest)), dtype=torch.uint8)


def decode_manifest(tensor: torch.Tensor) -> AdapterSet:
    """The manifest a version carries; ValueError for a version that is not an adapter set."""
    try:
        return msgspec.msgpack.decode(bytes(tensor.cpu().tolist()), type=AdapterSet)  # a few KiB
    except msgspec.DecodeError as err:
        raise ValueError(f"this version's adapter manifest does not decode: {err}") from None


def tensor_name(adapter: str, key: str) -> str:
    return f"{adapter}/{key}"


def of_adapter(weights: Iterable[tuple[str, torch.Tensor]], entry: AdapterEntry) -> dict[str, torch.Tensor]:
    """``entry``'s factors out of a version's ``(name, tensor)`` pairs, by their PEFT names (views)."""
    prefix = entry.name + "/"
    found = {name[len(prefix):]: t for name, t in weights if name.startswith(prefix)}
    missing = [k for k in entry.tensors if k not in found]
    if missing:
        raise ValueError(f"adapter {entry.name!r} version {entry.version}: the version lacks {missing[:4]}")
    return {k: found[k] for k in entry.tensors}


_MERGE_BLOCK = 64 * 1024  # elements of a block of rows merged at a time (256 KiB of float32)


def base_name(key: str) -> str:
    """The base weight a factor adapts: ``base_model.model.X.lora_A.weight`` -> ``X.weight``."""
    match = _FACTOR.fullmatch(key)
    if match is None:
        raise ValueError(f"{key!r} is not a LoRA factor")
    return match.group(1).removeprefix("base_model.model.") + ".weight"


def merge(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``base + scaling * (b @ a)``, computed so that any machine gets the same bits: in float32,
    the product as a sum of ``rank`` outer products taken in order (``b[:, i] * a[i, :]``, one
    rounding per multiply and per add, no fused multiply-add and no BLAS, whose blocking would pick
    the order), times ``scaling``, added to the base in float32, cast back to the base's dtype.
    Each element's steps depend on that element alone, so the work goes in blocks of rows that stay
    in cache (twice the speed of whole-matrix passes, the same bits)."""
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0] or base.shape != (b.shape[0], a.shape[1]):
        raise ValueError(f"factors {tuple(b.shape)} x {tuple(a.shape)} do not adapt a weight of {tuple(base.shape)}")
    a32, b32 = a.to(torch.float32), b.to(torch.float32)
    rows, cols = base.shape
    block = max(1, _MERGE_BLOCK // max(cols, 1))
    merged = torch.empty(base.shape, dtype=torch.float32, device=base.device)
    delta = torch.empty((min(block, rows), cols), dtype=torch.float32, device=base.device)
    product = torch.empty_like(delta)
    for first in range(0, rows, block):
        last = min(rows, first + block)
        acc, term = delta[:last - first], product[:last - first]
        acc.zero_()
        for i in range(a32.shape[0]):
            torch.mul(b32[first:last, i:i + 1], a32[i:i + 1, :], out=term)
            acc.add_(term)
        acc.mul_(scaling)
        torch.add(base[first:last].to(torch.float32), acc, out=merged[first:last])
    return merged.to(base.dtype)


def merged_weights(base: Mapping[str, torch.Tensor], entry: AdapterEntry,
                   factors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base weights ``entry`` adapts, each merged with its factors (:func:`merge`), by their
    names in the base. ``ValueError`` naming a module the base does not have."""
    out: dict[str, torch.Tensor] = {}
    for key in entry.tensors:
        if not key.endswith("lora_A.weight"):
            continue
        name = base_name(key)
        if name not in base:
            raise ValueError(f"adapter {entry.name}@{entry.version} adapts {name}, which the base does not have")
        out[name] = merge(base[name], factors[key], factors[key.replace("lora_A.weight", "lora_B.weight")],
                          entry.scaling)
    return out


def merge_adapter(base: Mapping[str, torch.Tensor], adapter: Adapter) -> dict[str, torch.Tensor]:
    """``base`` (a state dict) with ``adapter`` merged into the weights it adapts, as a generator in
    merged mode computes it (:func:`merge`: bit for bit the same on any machine); the other tensors
    as they are. What a trainer saves to compare with, or serves from without LoRA kernels."""
    return {**base, **merged_weights(base, adapter.entry("adapter", 0), adapter.tensors)}
