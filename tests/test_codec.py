"""The delta codec alone (weightsync.encodings.codec): every case bit-exact, whichever of its two
implementations (numpy's, torch's) made the delta and whichever rebuilds it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from weightsync.encodings import codec
from weightsync.format.layout import BITS, Segment

pytest.importorskip("numpy")  # the numpy side of the pair (the suite's test extra has it)

DTYPES = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


@pytest.fixture
def impl(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], None]]:
    """``impl("torch")`` makes the codec run as where numpy is not installed; ``impl("numpy")`` back."""
    import numpy

    def use(which: str) -> None:
        monkeypatch.setattr(codec, "_numpy", [numpy if which == "numpy" else None])

    yield use


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _case(name: str, size: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Base and new bytes of one tensor of ``n`` elements of ``size`` bytes."""
    base = torch.randn(n, generator=gen, dtype=torch.float64).to(DTYPES[size]) if size > 1 else \
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    cur = base.clone()
    bits = cur.view(BITS[size])
    if name == "random":  # a few percent, as at RL learning rates: the lowest bits
        at = torch.randperm(n, generator=gen)[: max(n // 30, 1)]
        bits[at] ^= 1
    elif name == "all-changed":
        bits ^= 0x55
    elif name == "nan-bearing" and size > 1 and n >= 4:  # bit patterns float arithmetic would lose
        bits[:: 7] ^= 1
        cur[1] = float("nan")
        cur[2] = -0.0
        bits[3] = bits[1] ^ 1  # a NaN with another payload
        cur[n - 1] = float("-inf")
    elif name == "nan-bearing":
        bits[::7] ^= 0xFF
    return _bits(base), _bits(cur)


CASES = ["random", "all-changed", "none-changed", "nan-bearing"]


@pytest.mark.parametrize("made_by", ["numpy", "torch"])
@pytest.mark.parametrize("rebuilt_by", ["numpy", "torch"])
@pytest.mark.parametrize("size", [1, 2, 4, 8])
@pytest.mark.parametrize("case", CASES)
def test_every_case_is_rebuilt_bit_exact_by_either_implementation(impl, made_by: str, rebuilt_by: str, size: int,
                                                                  case: str) -> None:
    gen = torch.Generator().manual_seed(size * 31 + CASES.index(case))
    for n in (1, 7, 1001, 70_003):  # odd lengths: a last word only partly filled
        base, cur = _case(case, size, n, gen)
        segs = [Segment(0, base.numel(), size)]
        for auto in (True, False):
            impl(made_by)
            enc = codec.encode(cur, base, segs, auto=auto)
            impl(rebuilt_by)
            out = torch.full_like(cur, 0xAB)
            codec.decode(enc.wire, base, out, segs)
            assert torch.equal(out, cur), (n, auto)
            changed = int((cur.view(BITS[size]) != base.view(BITS[size])).sum())
            # sent as it is because it was dense (every element counted) or nothing else was smaller
            assert enc.changed == changed or (enc.modes[0] == codec.RAW and enc.changed == n)
            if case == "none-changed":
                assert enc.modes == (codec.SAME,) and enc.wire.numel() <= codec.longest(segs) - base.numel()


def test_both_implementations_make_the_same_bytes(impl) -> None:
    gen = torch.Generator().manual_seed(5)
    base, cur = _case("random", 2, 300_001, gen)
    segs = [Segment(0, base.numel(), 2)]
    wires = {}
    for which in ("numpy", "torch"):
        impl(which)
        wires[which] = codec.encode(cur, base, segs, auto=False).wire
    assert torch.equal(wires["numpy"], wires["torch"])


@pytest.mark.parametrize("offset", [2, 6])
def test_a_bucket_that_starts_off_a_word_boundary(impl, offset: int) -> None:
    """A bucket cut inside a tensor, at a byte that is not a multiple of 8 (its words are read
    from a copy); the gap segments between tensors are single bytes."""
    gen = torch.Generator().manual_seed(offset)
    base_all, cur_all = _case("random", 2, 100_000, gen)
    base, cur = base_all[offset:], cur_all[offset:]
    end = 4 + 2 * ((base.numel() - 4) // 2 - 1)
    segs = [Segment(0, 4, 1), Segment(4, end, 2), Segment(end, base.numel(), 1)]
    for which in ("numpy", "torch"):
        impl(which)
        enc = codec.encode(cur, base, segs, auto=False)
        out = torch.zeros_like(cur)
        codec.decode(enc.wire, base, out, segs)
        assert torch.equal(out, cur)
        assert enc.modes[1] == codec.SPARSE


def test_a_gap_longer_than_its_byte_and_a_changed_last_word(impl) -> None:
    """Two changes 10**6 words apart (a long gap) and one in the padded last word."""
    base = torch.zeros(8 * 1_000_003 + 5, dtype=torch.uint8)
    cur = base.clone()
    cur[8 * 3 + 1] = 1
    cur[8 * 1_000_001] = 2
    cur[-1] = 3
    segs = [Segment(0, base.numel(), 1)]
    for which in ("numpy", "torch"):
        impl(which)
        enc = codec.encode(cur, base, segs, auto=False)
        assert enc.modes == (codec.SPARSE,) and enc.changed == 3
        out = torch.empty_like(cur)
        codec.decode(enc.wire, base, out, segs)
        assert torch.equal(out, cur)


def test_a_payload_whose_frame_claims_more_than_the_segment_is_refused_before_it_is_read(impl) -> None:
    gen = torch.Generator().manual_seed(1)
    base, cur = _case("random", 2, 4096, gen)
    segs = [Segment(0, base.numel(), 2)]
    enc = codec.encode(cur, base, segs, auto=False)
    head = enc.wire[: 8 * codec.HEAD].clone().view(torch.int64)
    told = int(head[2])
    rows = codec._decompress(memoryview(bytes(enc.wire[8 * codec.HEAD: 8 * codec.HEAD + told])),
                             8 * codec.FIELDS).view(torch.int64)
    la = int(rows[3])
    huge = codec._bytes(codec._compressor().compress(bytes(10 * base.numel())))  # a frame of 80 KiB of zeros
    rows[3] = huge.numel()
    head[2] = rows.numel() * 8  # the table as it is
    forged = torch.cat([head.view(torch.uint8), rows.view(torch.uint8), huge, enc.wire[8 * codec.HEAD + told + la:]])
    for which in ("numpy", "torch"):
        impl(which)
        with pytest.raises(codec.DeltaError, match="says it holds"):
            codec.decode(forged, base, torch.empty_like(cur), segs)
