"""What a vLLM worker's own loaders read of each checkpoint tensor: the start of its receive plan.

A tensor-parallel worker's ``model.load_weights`` reads only its part of most checkpoint tensors
(a column-parallel weight's rows, a row-parallel weight's columns, its share of the vocabulary)
and all of a few (norms). :class:`LoadRecorder` watches one real load: every torch call made while
it is active is checked for arguments that are views into the checkpoint tensors handed to the
loader, and a call that reads such a view (its result is not itself a view of them: ``copy_``
into a parameter, ``to``, ``cat``, arithmetic) adds the view's elements to what was read of that
tensor, as a box (an offset and a shape per dimension). Nothing is hand-written per layer type:
whatever the loaders narrow, transpose or split is what is recorded, and a view whose elements
cannot be described as a box counts as the whole tensor (read whole). A tensor the loaders never
read (another rank's experts, a buffer the model recomputes) has no box.

The same recorder runs each time a sliced worker joins, before any version (:func:`bake`): the
model's layers are put back in checkpoint format on the meta device (vLLM's reload metadata), its
loaders run on meta tensors named and shaped as the last version the worker knows of, or before
any as the engine's own checkpoint files (:func:`checkpoint_specs`), and nothing is read or
written but shapes. There each parameter's
loader is also watched for what it writes of its parameter, and the plan says whether every engine
parameter element is written exactly once (its ``coverage``). Where that bake cannot run (no
checkpoint files, a loader that needs values), the first whole load records the plan instead.

Only :func:`bake` imports vLLM (inside it): the worker reports the plan in ``engine_plans``; with
``sliced=True`` it joins the channel wanting only those boxes (:func:`boxes`) and hands its loaders
each received box inside a tensor of the checkpoint's shape (:func:`expanded`); docs/vllm.md, "What
each worker reads".
"""

from __future__ import annotations

import bisect
import contextlib
import json
import math
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from weightsync.format.slicing import box_name, overlap

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, shape), one entry per dimension

# calls that only read a tensor's metadata, never its elements
_METADATA = frozenset({"size", "dim", "stride", "numel", "nelement", "storage_offset", "data_ptr", "element_size",
                       "is_contiguous", "untyped_storage", "__len__", "__get__", "is_floating_point",
                       "is_complex", "get_device", "__format__", "__repr__", "type", "dtype", "device"})


class LoadRecorder(TorchFunctionMode):
    """Records, while active, the box of each checkpoint tensor the calls read.

    Hand the loader the pairs through :meth:`watch`, which notes each tensor as it passes::

        with LoadRecorder() as rec:
            model.load_weights(rec.watch(pairs))
        rec.plan()
    """

    def __init__(self) -> None:
        super().__init__()
        self._tensors: dict[str, torch.Tensor] = {}  # held: their addresses cannot be reused while recording
        self._starts: list[int] = []  # each tensor's first byte, ascending (the tensors do not overlap)
        self._ranges: list[tuple[int, str]] = []  # (past its last byte, name), in the order of _starts
        self._meta: dict[int, str] = {}  # a meta tensor's storage (each has its own) -> its name
        self.read: dict[str, list[Box]] = {}  # per tensor, the disjoint boxes read of it
        self.not_boxes: set[str] = set()  # tensors read whole because a view of them was not a box
        self._target: tuple[str, torch.Tensor] | None = None  # the parameter whose loader runs (a bake)
        self.wrote: dict[str, list[Box]] = {}  # per parameter, each write its loader made into it

    def watch(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in pairs:
            if tensor.is_contiguous() and tensor.numel() > 0 and name not in self._tensors:
                self._tensors[name] = tensor
                if tensor.is_meta:
                    self._meta[_storage(tensor)] = name
                else:
                    first = tensor.data_ptr()
                    at = bisect.bisect(self._starts, first)
                    self._starts.insert(at, first)
                    self._ranges.insert(at, (first + tensor.numel() * tensor.element_size(), name))
            yield name, tensor

    def writing(self, name: str, param: torch.Tensor, loader: Callable[..., Any]) -> Callable[..., Any]:
        """``loader`` (a parameter's weight loader), recording what it writes of ``param``."""
        def load(*args: Any, **kwargs: Any) -> Any:
            held, self._target = self._target, (name, param)
            try:
                return loader(*args, **kwargs)
            finally:
                self._target = held
        return load

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self._tensors or getattr(func, "__name__", "") in _METADATA:
            return out
        if self._target is not None and args and isinstance(args[0], torch.Tensor) and \
                (_in_place(func) or getattr(func, "__name__", "") == "__setitem__"):
            self._written(func, args)
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        sources = [(a, name) for a in inputs if (name := self._owner(a)) is not None]
        if not sources:
            return out
        results = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if results and all(self._owner(o) is not None for o in results) and not _in_place(func):
            return out  # a view of the checkpoint (narrow, view, transpose, chunk): nothing read yet
        for view, name in sources:
            box, exact = _box(view, self._tensors[name])
            if not exact:
                self.not_boxes.add(name)
            self._add(name, box)
        return out

    def _written(self, func: Any, args: Any) -> None:
        """A write into the parameter whose loader runs: the box of it that ``args[0]`` covers."""
        assert self._target is not None
        name, param = self._target
        dest = args[0]
        if getattr(func, "__name__", "") == "__setitem__" and len(args) > 1:
            dest = dest[args[1]]
        if dest.numel() == 0 or _storage(dest) != _storage(param):
            return  # a scratch tensor of the loader's, not the parameter
        self.wrote.setdefault(name, []).append(_box(dest, param)[0])

    def _owner(self, t: torch.Tensor) -> str | None:
        """The checkpoint tensor whose bytes hold all of ``t``'s elements (a view of it), if any: a
        tensor that merely starts there (the receive slot the checkpoint tensors are views of) is none."""
        if t.numel() == 0:
            return None
        if t.is_meta:  # each meta checkpoint tensor has a storage of its own
            return self._meta.get(_storage(t))
        if not self._ranges:
            return None
        first_byte = t.data_ptr()
        past_byte = first_byte + (sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True)) + 1) \
            * t.element_size()
        at = bisect.bisect(self._starts, first_byte) - 1  # the one tensor that can hold its first byte
        if at < 0 or self._ranges[at][0] < past_byte:
            return None
        return self._ranges[at][1]

    def _add(self, name: str, box: Box) -> None:
        self.read[name] = _merged(self.read.get(name, []), box)

    def plan(self, params: dict[str, torch.Tensor] | None = None, source: str = "load") -> dict[str, Any]:
        """Plain data: per checkpoint tensor its shape, dtype and the disjoint boxes read, by
        ascending offset (``None``: never read; ``"whole_because"`` where a view of it was not a
        box), the bytes read against the bytes
        handed to the loader, where the plan came from (``"load"``: a real load; ``"meta"``: the
        bake) and, given the engine's ``params`` (a bake), their ``coverage``."""
        tensors: dict[str, dict[str, Any]] = {}
        needed, total = 0, 0
        for name, t in self._tensors.items():
            read = sorted(self.read.get(name, []))
            total += t.numel() * t.element_size()
            needed += sum(math.prod(b[1]) for b in read) * t.element_size()
            tensors[name] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                             "boxes": [[list(b[0]), list(b[1])] for b in read] or None}
            if name in self.not_boxes:
                tensors[name]["whole_because"] = "a view its loader read was not a box"
        out: dict[str, Any] = {"tensors": tensors, "needed_bytes": needed, "version_bytes": total, "source": source}
        if params is not None:
            out["coverage"] = coverage(params, self.wrote)
        return out


def coverage(params: dict[str, torch.Tensor], wrote: dict[str, list[Box]]) -> dict[str, Any]:
    """Whether the loaders wrote every element of every parameter exactly once: a parameter's
    writes are boxes, and disjoint boxes whose volumes add up to its size cover it once each."""
    uncovered, overlapping, short = [], [], []
    for name, param in params.items():
        boxes = wrote.get(name, [])
        if not boxes:
            uncovered.append(name)
            continue
        if any(overlap(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:]):
            overlapping.append(name)
        elif sum(math.prod(b[1]) for b in boxes) != param.numel():
            short.append(name)
    exact = len(params) - len(uncovered) - len(overlapping) - len(short)
    return {"parameters": len(params), "exact": exact, "uncovered": uncovered, "overlapping": overlapping,
            "partly_written": short}


def _merged(boxes: list[Box], box: Box) -> list[Box]:
    """``boxes`` (disjoint) with ``box`` read too: boxes inside another dropped, boxes that differ
    in one dimension only and touch there made one, and where two still overlap in part, all of
    them as the one box around them (no element is wanted twice)."""
    if any(_inside(box, b) for b in boxes):
        return boxes
    out = [b for b in boxes if not _inside(b, box)] + [box]
    merged = True
    while merged:
        merged = False
        for i, a in enumerate(out):
            for j in range(i + 1, len(out)):
                union = _union(a, out[j])
                if union is not None:
                    out[i], merged = union, True
                    del out[j]
                    break
            if merged:
                break
    if any(overlap(a, b) for i, a in enumerate(out) for b in out[i + 1:]):
        lo = tuple(min(b[0][d] for b in out) for d in range(len(box[0])))
        hi = tuple(max(b[0][d] + b[1][d] for b in out) for d in range(len(box[0])))
        return [(lo, tuple(h - o for h, o in zip(hi, lo, strict=True)))]
    return out


def _inside(a: Box, b: Box) -> bool:
    return all(ob <= oa and oa + na <= ob + nb for oa, na, ob, nb in zip(a[0], a[1], b[0], b[1], strict=True))


def _union(a: Box, b: Box) -> Box | None:
    """The one box that is ``a`` and ``b`` together, where they differ in one dimension and touch there."""
    differ = [d for d in range(len(a[0])) if (a[0][d], a[1][d]) != (b[0][d], b[1][d])]
    if len(differ) != 1:
        return None
    d = differ[0]
    if a[0][d] > b[0][d] + b[1][d] or b[0][d] > a[0][d] + a[1][d]:
        return None
    lo, hi = min(a[0][d], b[0][d]), max(a[0][d] + a[1][d], b[0][d] + b[1][d])
    return (a[0][:d] + (lo,) + a[0][d + 1:], a[1][:d] + (hi - lo,) + a[1][d + 1:])


def _storage(t: torch.Tensor) -> int:
    """An identity of ``t``'s storage (meta tensors have no addresses: their storages differ)."""
    return int(t.untyped_storage()._cdata)


def _in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.startswith("__")


def _box(view: torch.Tensor, base: torch.Tensor) -> tuple[Box, bool]:
    """The box of ``base`` (contiguous) that ``view`` (in the same storage) covers, and True; the
    whole of ``base`` and False where the view's elements are not a box (a reshape across rows)."""
    whole: Box = ((0,) * base.dim(), tuple(int(n) for n in base.shape))
    if base.dim() == 0:
        return whole, True
    offset = int((view.storage_offset() * view.element_size() - base.storage_offset() * base.element_size())
                 // base.element_size())
    if offset < 0 or view.element_size() != base.element_size():
        return whole, False
    strides = [int(s) for s in base.stride()]
    start: list[int] = []
    for s in strides:
        start.append(offset // s)
        offset %= s
    extent = [0] * base.dim()
    for n, s in zip(view.shape, view.stride(), strict=True):
        if n <= 1:
            continue
        dim = next((d for d in range(base.dim()) if s % strides[d] == 0 and (d == 0 or s < strides[d - 1])), None)
        if dim is None:
            return whole, False
        extent[dim] += (n - 1) * (s // strides[dim])
    if any(b + e >= size for b, e, size in zip(start, extent, base.shape, strict=True)):
        return whole, False  # the view runs past a row: its elements are not one box
    return (tuple(start), tuple(e + 1 for e in extent)), True


def boxes(plan: dict[str, Any]) -> dict[str, Any]:
    """A plan's boxes as ``Subscriber(want=)`` takes them, each with its tensor's whole shape (a
    version shaped otherwise is refused): one box, or a list of them where the loaders read
    several of one tensor (a fused weight's halves); tensors never read are not wanted."""
    out: dict[str, Any] = {}
    for name, spec in plan["tensors"].items():
        read = [(tuple(o), tuple(n), tuple(spec["shape"])) for o, n in spec["boxes"] or ()]
        if read:
            out[name] = read[0] if len(read) == 1 else read
    return out


def expanded(pairs: Iterable[tuple[str, torch.Tensor]], plan: dict[str, Any]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """Each received tensor's boxes as the loaders expect them: in a tensor of the checkpoint
    tensor's shape, zeros around them (the loaders read only the boxes: that is how they were
    recorded), handed on once its last box arrived (a tensor's boxes arrive one after the other,
    ``name[i]`` where there are several: ``slicing.box_name``). One such tensor is alive at a time
    while the loader consumes the pairs one by one."""
    lookup: dict[str, tuple[str, list[int], list[int], int]] = {}
    for name, spec in plan["tensors"].items():
        read = spec["boxes"] or []
        for i, (offset, shape) in enumerate(read):
            lookup[box_name(name, i, len(read))] = (name, offset, shape, len(read))
    held: dict[str, tuple[torch.Tensor, int]] = {}
    for entry, part in pairs:
        hit = lookup.get(entry)
        if hit is None:
            yield entry, part
            continue
        name, offset, shape, count = hit
        whole_shape = plan["tensors"][name]["shape"]
        if count == 1 and list(part.shape) == whole_shape:
            yield name, part
            continue
        got = held.pop(name, None)
        whole, left = got if got is not None else (part.new_zeros(whole_shape), count)
        whole[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))].copy_(part)
        if left > 1:
            held[name] = (whole, left - 1)
        else:
            yield name, whole


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                       "F8_E5M2": torch.float8_e5m2}


def specs(plan: dict[str, Any]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The names, shapes and dtypes of the tensors a plan was recorded from (a version's)."""
    return [(name, tuple(spec["shape"]), getattr(torch, spec["dtype"])) for name, spec in plan["tensors"].items()]


def checkpoint_specs(model_dir: str | Path) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The names, shapes and dtypes of the tensors in a checkpoint directory's ``*.safetensors``
    files, from their headers alone (no tensor is read). Raises ValueError where there are none
    (a hub name, a ``dummy`` load) or a header is not safetensors."""
    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    if not files:
        raise ValueError(f"no *.safetensors files in {str(model_dir)!r}")
    specs = []
    for path in files:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 << 20:
                raise ValueError(f"{path}: a header of {size} bytes is not safetensors")
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype"))
            if dtype is None:
                raise ValueError(f"{path}: {name!r} has dtype {entry.get('dtype')!r}, which this plan cannot make")
            specs.append((name, tuple(int(n) for n in entry["shape"]), dtype))
    return specs


def bake(model: torch.nn.Module, specs: Iterable[tuple[str, tuple[int, ...], torch.dtype]]) -> dict[str, Any]:
    """The plan of one vLLM worker before any version arrives: its model's own ``load_weights`` run
    once on meta tensors named and shaped as ``specs``, with every layer put back on the meta device
    in checkpoint format (vLLM's reload metadata, as its layerwise reload does) and each parameter's
    weight loader watched for what it writes. The worker's real tensors are put back afterwards,
    untouched (only meta tensors are read and written). Raises where a loader cannot run on meta
    tensors (it needs values): the caller records the plan from a real load instead."""
    from vllm.model_executor.model_loader.reload.layerwise import _get_original_loader, get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import SKIP_TENSORS, restore_layer_on_meta, to_meta_tensor
    from vllm.model_executor.model_loader.reload.utils import get_layer_params_buffers, get_layer_tensors

    kept = []
    attrs: list[tuple[torch.Tensor, dict[str, Any]]] = []  # each parameter's attributes, its loader among them
    try:
        for layer in model.modules():
            kept.append((layer, get_layer_params_buffers(layer), set(layer._non_persistent_buffers_set)))
            restore_layer_on_meta(layer, get_layerwise_info(layer))
            for table in (layer._parameters, layer._buffers):  # what vLLM keeps real (a bias): meta too
                for name, tensor in table.items():
                    if tensor is not None and not tensor.is_meta and name not in SKIP_TENSORS - {"bias"}:
                        table[name] = to_meta_tensor(tensor)
        params: dict[str, torch.Tensor] = dict(model.named_parameters())
        if not params or not all(p.is_meta for p in params.values()):
            raise RuntimeError("this model's layers have no reload metadata to put them on the meta device")
        recorder = LoadRecorder()
        for name, param in params.items():
            attrs.append((param, dict(param.__dict__)))  # (vLLM's own parameters keep it behind a property)
            param.weight_loader = recorder.writing(name, param, _get_original_loader(param))  # type: ignore[attr-defined]
        checkpoint = [(name, torch.empty(shape, dtype=dtype, device="meta")) for name, shape, dtype in specs]
        with recorder, torch.no_grad():
            model.load_weights(recorder.watch(checkpoint))  # type: ignore[operator]
        return recorder.plan(params, source="meta")
    finally:
        for param, held in attrs:
            param.__dict__.clear()
            param.__dict__.update(held)
        for layer, (params_, buffers), non_persistent in kept:
            for name in get_layer_tensors(layer):
                with contextlib.suppress(AttributeError):
                    delattr(layer, name)
            for name, tensor in params_.items():
                layer.register_parameter(name, tensor)
            for name, tensor in buffers.items():
                layer.register_buffer(name, tensor, persistent=name not in non_persistent)
