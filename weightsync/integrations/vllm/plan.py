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

This module imports torch only (no vLLM): the worker wraps its full loads in a recorder and
reports the plan (:meth:`LoadRecorder.plan`) in ``engine_info``; with ``sliced=True`` it then
joins the channel wanting only those boxes (:func:`boxes`) and hands its loaders each received box
inside a tensor of the checkpoint's shape (:func:`expanded`); docs/vllm.md, "What each worker
reads".
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

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
        self.read: dict[str, Box] = {}

    def watch(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in pairs:
            if tensor.is_contiguous() and tensor.numel() > 0 and name not in self._tensors:
                self._tensors[name] = tensor
                first = tensor.data_ptr()
                at = bisect.bisect(self._starts, first)
                self._starts.insert(at, first)
                self._ranges.insert(at, (first + tensor.numel() * tensor.element_size(), name))
            yield name, tensor

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self._ranges or getattr(func, "__name__", "") in _METADATA:
            return out
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        sources = [(a, name) for a in inputs if (name := self._owner(a)) is not None]
        if not sources:
            return out
        results = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if results and all(self._owner(o) is not None for o in results) and not _in_place(func):
            return out  # a view of the checkpoint (narrow, view, transpose, chunk): nothing read yet
        for view, name in sources:
            self._add(name, _box(view, self._tensors[name]))
        return out

    def _owner(self, t: torch.Tensor) -> str | None:
        """The checkpoint tensor whose bytes hold all of ``t``'s elements (a view of it), if any: a
        tensor that merely starts there (the receive slot the checkpoint tensors are views of) is none."""
        if t.device.type == "meta" or t.numel() == 0:
            return None
        first_byte = t.data_ptr()
        past_byte = first_byte + (sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True)) + 1) \
            * t.element_size()
        at = bisect.bisect(self._starts, first_byte) - 1  # the one tensor that can hold its first byte
        if at < 0 or self._ranges[at][0] < past_byte:
            return None
        return self._ranges[at][1]

    def _add(self, name: str, box: Box) -> None:
        held = self.read.get(name)
        if held is None:
            self.read[name] = box
            return
        lo = tuple(min(a, b) for a, b in zip(held[0], box[0], strict=True))
        hi = tuple(max(a + n, b + m) for a, n, b, m in zip(held[0], held[1], box[0], box[1], strict=True))
        self.read[name] = (lo, tuple(h - lo_ for h, lo_ in zip(hi, lo, strict=True)))

    def plan(self) -> dict[str, Any]:
        """Plain data: per checkpoint tensor its shape and the box read (``None``: never read), and
        the bytes read against the bytes handed to the loader."""
        tensors, needed, total = {}, 0, 0
        for name, t in self._tensors.items():
            box = self.read.get(name)
            total += t.numel() * t.element_size()
            if box is not None:
                count = 1
                for n in box[1]:
                    count *= n
                needed += count * t.element_size()
            tensors[name] = {"shape": list(t.shape), "box": None if box is None else [list(box[0]), list(box[1])]}
        return {"tensors": tensors, "needed_bytes": needed, "version_bytes": total}


def _in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return name.endswith("_") and not name.startswith("__")


def _box(view: torch.Tensor, base: torch.Tensor) -> Box:
    """The box of ``base`` (contiguous) that ``view`` covers; the whole of ``base`` where the
    view's elements are not a box (a reshape across rows)."""
    whole: Box = ((0,) * base.dim(), tuple(base.shape))
    if base.dim() == 0:
        return whole
    offset = (view.data_ptr() - base.data_ptr()) // base.element_size()
    strides = base.stride()
    start = []
    for s in strides:
        start.append(offset // s)
        offset %= s
    extent = [0] * base.dim()
    for n, s in zip(view.shape, view.stride(), strict=True):
        if n <= 1:
            continue
        dim = next((d for d in range(base.dim()) if s % strides[d] == 0 and (d == 0 or s < strides[d - 1])), None)
        if dim is None:
            return whole
        extent[dim] += (n - 1) * (s // strides[dim])
    if any(b + e >= size for b, e, size in zip(start, extent, base.shape, strict=True)):
        return whole  # the view runs past a row: its elements are not one box
    return tuple(start), tuple(e + 1 for e in extent)


def boxes(plan: dict[str, Any]) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """A plan's boxes as ``Subscriber(want=)`` takes them; tensors never read are not wanted."""
    return {name: (tuple(spec["box"][0]), tuple(spec["box"][1])) for name, spec in plan["tensors"].items()
            if spec["box"] is not None}


def expanded(pairs: Iterable[tuple[str, torch.Tensor]], plan: dict[str, Any]
             ) -> Iterator[tuple[str, torch.Tensor]]:
    """Each received box as the loaders expect it: in a tensor of the checkpoint tensor's shape,
    zeros around it (the loaders read only the box: that is how it was recorded). One such tensor
    is alive at a time while the loader consumes the pairs one by one."""
    for name, part in pairs:
        spec = plan["tensors"].get(name)
        if spec is None or spec["box"] is None or list(part.shape) == spec["shape"]:
            yield name, part
            continue
        whole = part.new_zeros(spec["shape"])
        offset, shape = spec["box"]
        whole[tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))].copy_(part)
        yield name, whole
