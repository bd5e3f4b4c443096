"""The built-in delta encodings, ``"delta"`` and ``"auto"``, on the encoding seam.

A version goes as a delta against a *base*: the publisher's retained version (the newest one
sent), which every member it goes to acknowledged whole. The Announce names the base's number
and digest (:func:`weightsync.encodings.seam.base_digest`: over its per-bucket checksums), and a
member decodes only on exactly that base, its readable slot; the digests it checks are the
reconstructed bytes'. Each bucket is encoded by :mod:`weightsync.encodings.codec`.

- ``"delta"``: every segment as its smallest delta form (sparse, XOR, or as it is);
- ``"auto"``: sparse where it is small, as it is where a segment's sampled change is dense, and
  the whole version as ``"full"`` where its sampled delta would not halve its bytes (decoding
  one costs a copy of the base and the wire is fast enough on one host that a smaller saving
  lost time). The sample decides before any bucket is made: buckets go as they are made.

Where the version goes ``"full"`` instead (the plan's ``encoding``), with no delta made:

- no base yet, or a base in another layout (a new manifest);
- a member in the version that is not known to hold the base (a newcomer, a replacement, a
  member that rejoined or missed the base, or whose last delta failed);
- checksums off (nothing would prove the reconstruction), ``copy=False`` without a kept copy
  (no snapshot to compare; a ``copy=False`` put asking for ``"delta"`` makes the publisher keep
  a copy of what it sends, :class:`KeptBase`, and from then on each bucket is encoded as it is
  packed).

A sharded rank's lane goes as a delta against that rank's own retained part (each rank encodes
its own shards); a member rebuilds it against the same part of its readable version, gathered
from the whole slot where the lane's bytes lie (``sharding.Placer.gather``). A sliced member
(sent its share point to point) is decided alone: one that holds its share of the base (named
by its own digests) is sent a delta of its share of each bucket against the same runs of the
base (:func:`share_coder`), rebuilt against its own slot (``slicing.SlicePlacer.held``).

A member that cannot decode (no such base, a corrupted or forged delta) still takes part in the
whole transfer, then refuses the version as corrupt; the publisher re-sends it ``"full"`` in the
same generation (see :class:`weightsync.engine.sender.Sender`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import wait
from typing import Any

import torch

from weightsync import _wire
from weightsync._errors import ChecksumMismatch, ProtocolError
from weightsync.encodings import codec
from weightsync.encodings.seam import AUTO, DELTA, FULL, Base, Decoder, Encoder, EncodingSpec, WirePlan, base_digest
from weightsync.format import layout, sharding, slicing
from weightsync.format.checksum import checksum

WORTH = 0.5  # auto: a version whose delta is more than this share of its bytes goes full
#: buckets go as they are made (False: the whole version is made before its first bucket goes, as
#: before protocol 12; for benchmarks.delta's side-by-side comparison only)
OVERLAP = True


def why_full(out: Any, base: Base | None, to: Sequence[str]) -> str:
    """Why ``out`` cannot go as a delta to members ``to`` ("" when it can)."""
    if out.snapshot is None and not out.keeps_base:
        return "copy=False keeps no base (put(..., encoding='delta') keeps one)"
    if base is None:
        return "no base version"
    if base.version >= out.version:
        return f"the base {base.version} is not older"
    if base.assembly != out.assembly:
        return "the sharded layout changed"
    if not out.checksum:
        return "checksums are off"
    if base.manifest != out.manifest:
        return "the layout changed"
    missing = [m for m in to if m not in base.holders]
    if missing:
        return f"{len(missing)} member(s) lack the base, e.g. {missing[0]}"
    return ""


COSTED_FROM = 1 << 20  # versions smaller than this do not say which encoding is faster
EXPLORE = 16  # "auto" tries the encoding it found slower once every this many versions


class Chooser:
    """``"auto"``'s choice between full versions and deltas, by what each cost this channel lately.

    A version's cost is the sender's time from the start of its send to its last acknowledgement
    (making the delta, moving it, the members' decoding and checking), per staged byte, as a
    moving average per kind. On one host a fast wire can beat what a delta costs the CPUs; over
    slower links the delta wins; which one holds is measured, not assumed. Every ``EXPLORE``-th
    choice tries the slower one again, so a change (a learning rate, a link, a load) is noticed.
    The first delta pays for starting up (its threads, the members' new buffers) and is not
    counted; until a second one was measured the delta is tried. Only the sender thread uses it.
    """

    def __init__(self) -> None:
        self.cost: dict[bool, float] = {}  # delta? -> seconds per staged byte
        self.seen: dict[bool, int] = {False: 0, True: 0}
        self._chosen = 0

    def note(self, delta: bool, nbytes: int, seconds: float) -> None:
        if nbytes >= COSTED_FROM:
            self.seen[delta] += 1
            if delta and self.seen[delta] == 1:
                return  # the first one started things up
            per, old = seconds / nbytes, self.cost.get(delta)
            self.cost[delta] = per if old is None else 0.6 * old + 0.4 * per

    def prefer_full(self) -> bool:
        full, delta = self.cost.get(False), self.cost.get(True)
        if full is None or delta is None:
            return False
        self._chosen += 1
        return (full < delta) != (self._chosen % EXPLORE == 0)


class KeptBase:
    """``copy=False``'s base: the publisher's own copy of the last version it sent (there is no
    snapshot to keep), one version's bytes on the buckets' device, made by the first ``copy=False``
    put that asks for ``encoding="delta"`` and refreshed by every later one (a full one included),
    until a put with a snapshot.

    Each bucket is copied in as it is packed (after the encoder read the base's bytes of it), so
    the copy holds a version whole once all of it was packed; one left half-way holds none
    (``version`` -1). The Sender re-sends a released version from a copy that holds it (a member
    whose delta did not apply, a member lost mid-version): the caller's tensors are never read
    again. Only the sender thread uses it.
    """

    def __init__(self, manifest: Any, assembly: Any, device: torch.device) -> None:
        self.manifest, self.assembly = manifest, assembly
        self.flat = torch.empty(manifest.total_bytes, dtype=torch.uint8, device=device)
        self.version = -1  # the version whose every byte it holds; -1: none whole
        self.digests: tuple[int, ...] = ()  # that version's staged digests, once sent with them

    def fits(self, manifest: Any, assembly: Any, device: torch.device) -> bool:
        return self.manifest == manifest and self.assembly == assembly and self.flat.device == device

    def base(self, holding: Callable[[int], tuple[frozenset[str], dict[str, bytes]]]) -> Base | None:
        """The base a next version may go as a delta against, with the members that hold it (and
        sliced members' shares of it): ``holding(version)``, the Sender's word."""
        if self.version < 0 or not self.digests:
            return None
        holders, shares = holding(self.version)
        return Base(self.version, self.flat, self.manifest, base_digest(self.version, self.digests), holders,
                    assembly=self.assembly, shares=shares)

    def refill(self, out: Any, version: int) -> None:
        """Copy each bucket of ``out`` (an attempt at ``version`` packed from the caller's tensors)
        in once it is packed and encoded (the encoder read the base's bytes of it first): from now
        on the copy holds no version whole, until every bucket of this one was packed."""
        self.version, self.digests = -1, ()
        left = set(range(len(out.ranges)))

        def outer(inner: Callable[[int], None]) -> Callable[[int], None]:
            def packed_then_kept(i: int) -> None:
                inner(i)
                if i in left:
                    lo, hi = out.ranges[i]
                    self.flat[lo:hi].copy_(out.buckets[i])
                    left.discard(i)
                    if not left:
                        self.version = version
            return packed_then_kept

        out.wrap(outer)


class SendBases:
    """The publisher's end of the delta encodings' bookkeeping, which the Sender asks and tells.

    It knows which member holds which version whole (a delta goes only to members holding its
    base; a sliced member: its share, named by the digests of its share), what ``"auto"`` measured
    (:class:`Chooser`) and the ``copy=False`` copy deltas are against (:class:`KeptBase`). A member
    is forgotten when it joins again and when a delta it was sent did not apply. Only the sender
    thread uses it.
    """

    def __init__(self, device: torch.device) -> None:
        self._holds: dict[str, int] = {}  # member -> the version it acknowledged whole last
        self._shares: dict[str, bytes] = {}  # a sliced member in _holds: the digest of its share of it
        self._device = device
        self.chooser = Chooser()
        self.kept: KeptBase | None = None
        self.sent_delta = False  # the last attempt sent some member a delta
        self._staged: tuple[dict[str, int], dict[str, bytes]] = ({}, {})  # acked, held once committed

    def forget(self, *members: str) -> None:
        """No base is known for ``members`` (a newcomer, a rejoin, a delta that did not apply)."""
        for member in members:
            self._holds.pop(member, None)
            self._shares.pop(member, None)

    def keep_for(self, job: Any, encoding: str) -> KeptBase | None:
        """The copy a ``copy=False`` version's delta is against: made by the first copy=False put that
        asks for ``encoding="delta"`` (it costs a version's bytes), then refreshed by every copy=False
        put, whatever its encoding (a full one is the next base too); a snapshot's put drops it."""
        if job.flat is not None:
            self.kept = None  # a snapshot is its own next base
            return None
        if self.kept is None and encoding != DELTA:
            return None  # copy=False that never asked for a delta keeps its two buckets' memory
        if self.kept is None or not self.kept.fits(job.manifest, job.assembly, self._device):
            self.kept = None  # the old layout's copy goes before the new one is made: never two at once
            self.kept = KeptBase(job.manifest, job.assembly, self._device)
        return self.kept

    def resendable(self, job: Any) -> bool:
        """A copy=False version whose tensors were let go can be sent again only from a copy of it:
        a whole spill (``Job.spill_ahead``), or the copy kept as deltas' base."""
        kept = self.kept
        return (job.flat is not None or not job.released.is_set() or job.whole_spill()
                or (kept is not None and kept.version == job.version))

    def base(self, job: Any, retained: Any, kept: KeptBase | None) -> Base | None:
        """What ``job`` may go as a delta against: the ``retained`` version (staging keeps it while
        ``job`` is in flight), named by its digests (copy=False: the ``kept`` copy); with the members
        known to hold it."""
        if job.flat is None:
            return None if kept is None else kept.base(self.holding)
        if retained is None or retained.flat is None or not retained.digests or job is retained:
            return None
        holders, shares = self.holding(retained.version)
        return Base(retained.version, retained.flat, retained.manifest,
                    base_digest(retained.version, retained.digests), holders,
                    assembly=retained.assembly, shares=shares)

    def holding(self, version: int) -> tuple[frozenset[str], dict[str, bytes]]:
        """The members known to hold ``version`` whole, and the sliced ones' digests of their shares of it."""
        shares = {m: d for m, d in self._shares.items() if self._holds.get(m) == version}
        return frozenset(m for m, v in self._holds.items() if v == version and m not in self._shares), shares

    def _hold(self, holders: dict[str, int], shares: dict[str, bytes]) -> None:
        self._holds.update(holders)
        for member in holders:
            self._shares.pop(member, None)
        self._shares.update(shares)

    def sent(self, prepared: Any) -> bool:
        """After ``prepare``: whether this attempt sends some member a delta (each part's ``Prepared``)."""
        self.sent_delta = any(c.name != FULL for got in prepared.values() for c in got.codings())
        return self.sent_delta

    def acknowledged(self, job: Any, out: Any, acked: set[str], sliced: Mapping[str, Sequence[int]],
                     digests: tuple[int, ...] | None, *, verify: bool, staged: bool) -> None:
        """``acked`` hold ``job`` now (``staged``: once committed, :meth:`committed`). ``digests``:
        the staged buckets' (None: not all taken), which name the version as the next base; a sliced
        member holds its share, named by the digests it was sent (none without checksums: no base)."""
        if digests is not None and self.kept is not None and self.kept.version == job.version:
            self.kept.digests = digests
        holders = dict.fromkeys((m for m in acked if m not in sliced or verify), job.version)
        shares = {m: base_digest(job.version, sliced[m]) for m in acked if m in sliced and verify}
        self._staged = (holders, shares) if staged else ({}, {})
        if not staged:
            self._hold(holders, shares)
        if self.sent_delta and out.base is not None:
            job.base = out.base.version

    def committed(self, exposed: Any) -> None:
        """Activation "all": the members that exposed the version hold it."""
        holders, shares = self._staged
        self._hold({m: v for m, v in holders.items() if m in exposed},
                   {m: d for m, d in shares.items() if m in exposed})
        self._staged = ({}, {})


class DeltaEncoder(Encoder):
    def __init__(self, auto: bool) -> None:
        self.auto = auto

    def share(self, out: Any, member: str, plan: Sequence[Sequence[Any]], want: Any
              ) -> tuple[Callable[[int, torch.Tensor], torch.Tensor], _wire.Coding] | None:
        """A sliced member's share of each bucket as a delta of its share of the base (``plan``: its
        routes, ``want``: its boxes), or None where it goes full (:func:`share_coder`)."""
        full = out.manifest if out.assembly is None else out.assembly.manifest
        pieces = None if out.assembly is None else out.assembly.pieces
        segments = slicing.cached_share_segments(out.manifest, pieces, full, want, tuple(out.ranges))
        return share_coder(out, member, plan, segments)

    def plan(self, out: Any) -> WirePlan:
        base: Base | None = out.base
        out.full_reason = why_full(out, base, out.receivers)
        if not out.full_reason and self.auto and out.prefer_full:
            out.full_reason = "full versions reached this group faster than deltas lately"
        if out.full_reason:
            return WirePlan(out.buckets, encoding=FULL)
        assert base is not None
        if out.snapshot is None:
            return _as_packed(out, base, self.auto)
        total = out.manifest.total_bytes
        if self.auto:  # from samples first: a version that changed through and through is not compared whole
            out.full_reason = sampled_full(out, base)  # (the whole version, a pipelined snapshot waited for)
            if out.full_reason:
                return WirePlan(out.buckets, encoding=FULL)
        elif out.progress is not None:  # a pipelined snapshot: the whole version is compared before it goes
            out.progress.wait(total, out.deadline(total))
        began = time.monotonic() - out.encode_seconds  # the sample's time counts

        made = [began]  # when the last bucket was made (the encode time: not the wire's pace)

        def one(i: int) -> tuple[torch.Tensor, int]:  # torch's ops, zstd and the digests let go of the GIL
            made_i = _encoded(out, base, i, self.auto)
            made.append(time.monotonic())
            return made_i

        # every bucket is encoded on the pool at once, in order; bucket i goes once it is made, while
        # the ones after it are still being made and the members decode the ones before it
        n = len(out.ranges)
        jobs = [out.workers.submit(one, i) for i in range(n)]
        if not OVERLAP:
            wait(jobs, timeout=out.deadline(total))
        wire: list[torch.Tensor] = [_NOTHING] * n
        out.staged_digests = [0] * n  # the staged bytes': valid whatever goes
        plan = WirePlan(wire, encoding=DELTA, base=base.version, base_digest=base.digest, later=True)

        def encode(i: int) -> None:
            if i < len(plan.told):
                return  # made and told already (a re-walk of the hooks)
            lo, hi = out.ranges[i]
            first, sizes = i, []
            for j in range(i, n):  # bucket i, and every later one made by now: one WireSizes for them all
                if j > i and not jobs[j].done():
                    break
                wire[j], out.staged_digests[j] = jobs[j].result(timeout=out.deadline(hi - lo))
                sizes.append(wire[j].numel())
            plan.told.extend(sizes)
            if len(plan.told) == n:
                out.encode_seconds = max(made) - began
            out.tell_sizes(first, tuple(sizes))

        def close() -> None:  # the rest is not wanted (a version given up on): its base may be reused
            for job in jobs:
                job.cancel()
            wait(jobs, timeout=max(out.deadline(out.bucket_bytes), 1.0))

        plan.hook, plan.close = encode, close
        return plan


_NOTHING = torch.empty(0, dtype=torch.uint8)  # a wire bucket not made yet


def sampled_full(out: Any, base: Base) -> str:
    """``"auto"`` with a snapshot: why the version goes full by a sample of what changed ("" when a
    delta would take at most ``WORTH`` of it); the whole version is compared first (a pipelined
    snapshot is waited for). Its time counts as encode time."""
    total = out.manifest.total_bytes
    if out.progress is not None:
        out.progress.wait(total, out.deadline(total))
    began = time.monotonic()
    guess = sum(codec.estimate(out.buckets[i], base.flat[lo:hi], layout.segments(out.manifest, lo, hi))
                for i, (lo, hi) in enumerate(out.ranges))
    out.encode_seconds += time.monotonic() - began
    return f"sampled, the delta would be about {guess / max(total, 1):.0%} of the version" \
        if guess > WORTH * total else ""


def _encoded(out: Any, base: Base, i: int, auto: bool) -> tuple[torch.Tensor, int]:
    """Staged bucket ``i`` of ``out`` as a delta against ``base`` (on the bucket's device), and the
    staged bucket's digest (0 with checksums off or an empty bucket)."""
    lo, hi = out.ranges[i]
    bucket = out.buckets[i]
    enc = codec.encode(bucket, base.flat[lo:hi], layout.segments(out.manifest, lo, hi), auto=auto)
    return enc.wire.to(bucket.device), checksum(bucket, out.digest) if out.checksum and bucket.numel() else 0


def _as_packed(out: Any, base: Base, auto: bool) -> WirePlan:
    """``copy=False`` against the publisher's kept copy (:class:`KeptBase`): bucket i is packed into
    one of two buffers just before it goes, so it is encoded then, on the sender thread, each
    segment as :func:`weightsync.encodings.codec.encode` chooses (``auto``: dense ones as they are).
    Nothing is sampled ahead (there is nothing to sample yet): a version that changed through and
    through goes as a delta of segments as they are, a table's bytes more than full."""
    n = len(out.ranges)
    wire: list[torch.Tensor] = [_NOTHING] * n
    out.staged_digests = [0] * n
    plan = WirePlan(wire, encoding=DELTA, base=base.version, base_digest=base.digest, later=True)

    def encode(i: int) -> None:
        if i < len(plan.told):
            return  # made and told already (a re-walk of the hooks)
        began = time.monotonic()
        wire[i], out.staged_digests[i] = _encoded(out, base, i, auto)
        out.encode_seconds += time.monotonic() - began
        plan.told.append(wire[i].numel())
        out.tell_sizes(i, (wire[i].numel(),))

    plan.hook = encode
    return plan


def share_coder(out: Any, member: str, plan: Sequence[Sequence[Any]], segments: Sequence[Sequence[layout.Segment]]
                ) -> tuple[Callable[[int, torch.Tensor], torch.Tensor], _wire.Coding] | None:
    """A sliced member's deltas: ``code(i, share)``, its share of bucket i (``plan``: its routes)
    encoded against its share of the base, each segment as :func:`weightsync.encodings.codec.encode`
    chooses (``"auto"``: dense ones as they are), its length told to it alone; and the Announce
    fields it gets. None where it goes full: it does not hold its share of the base, or the version
    goes full for everyone (:func:`why_full`; ``"auto"`` with a snapshot: a sample of the whole
    version says a delta would not halve it, :func:`sampled_full`, taken once per version)."""
    base: Base | None = out.base
    if why_full(out, base, ()) or (out.encoding == AUTO and out.prefer_full):
        return None
    assert base is not None
    digest = base.shares.get(member)
    if digest is None:
        return None
    auto = out.encoding == AUTO
    if auto and out.snapshot is not None:  # sampled once per version, over the whole of it (as a broadcast)
        if out.share_sample is None:
            out.share_sample = sampled_full(out, base)
        if out.share_sample:
            return None

    def code(i: int, share: torch.Tensor) -> torch.Tensor:
        began = time.monotonic()
        lo, hi = out.ranges[i]
        held = slicing.gather(base.flat[lo:hi], plan[i])
        wire = codec.encode(share, held, segments[i], auto=auto).wire.to(share.device)
        out.encode_seconds += time.monotonic() - began
        out.tell_sizes(i, (wire.numel(),), (member,))
        return wire

    return code, _wire.Coding(name=DELTA, base=base.version, base_digest=digest, later=True)


class DeltaDecoder(Decoder):
    def plan(self, announce: Any, buckets: Sequence[torch.Tensor], base: Base | None = None,
             sizes: Callable[[int], int] | None = None,
             segments: Callable[[int], Sequence[Any]] | None = None) -> WirePlan:
        """``segments``: a sliced member's, bucket i's share cut into its segments (``buckets`` are
        its shares); None: each bucket of the manifest's layout."""
        manifest = announce.manifest
        ranges = (layout.bucket_ranges(manifest.total_bytes, announce.bucket_bytes) if announce.assembly is None
                  else sharding.bucket_plan(manifest, announce.bucket_bytes))
        if len(ranges) != len(buckets) or not announce.coding.later or sizes is None:
            raise ChecksumMismatch(f"version {announce.version}: a delta whose wire buckets are not told as they "
                                   f"go, or of {len(ranges)} buckets for {len(buckets)}")
        refused = ""
        if base is None:
            refused = "this member holds no base version"
        elif (base.version, base.digest) != (announce.coding.base, announce.coding.base_digest):
            refused = (f"this member holds version {base.version}, not the base {announce.coding.base} "
                       "(or not its bytes)")
        elif base.manifest != manifest or base.assembly != announce.assembly:
            refused = "the base is in another layout"
        device = buckets[0].device if buckets else torch.device("cpu")
        wire: list[torch.Tensor] = [_NOTHING] * len(buckets)
        problems: list[str] = []

        def segs(i: int) -> Sequence[layout.Segment]:
            lo, hi = ranges[i]
            return layout.segments(manifest, lo, hi) if segments is None else segments(i)

        def size(i: int) -> None:  # bucket i's told length, bounded by what a delta of it can take
            told, most = sizes(i), codec.longest(segs(i))
            if not 0 <= told <= most:  # the publisher's word, on our own connection: not a relay's
                raise ProtocolError(f"version {announce.version}: wire bucket {i} told as {told} bytes, "
                                    f"a delta of it takes at most {most}")
            wire[i] = torch.empty(told, dtype=torch.uint8, device=device)

        def decode(i: int) -> None:
            if refused or problems:
                return  # the rest is received and dropped: the collective completes
            assert base is not None
            lo, hi = ranges[i]
            try:
                held = base.flat[lo:hi] if base.part is None else base.part(i)
                codec.decode(wire[i], held, buckets[i], segs(i))
            except codec.DeltaError as err:
                problems.append(f"bucket {i}: {err}")
            wire[i] = _NOTHING  # decoded: its bytes are not held to the end of the version

        def check() -> None:
            if refused or problems:
                raise ChecksumMismatch(refused or problems[0])

        return WirePlan(wire, hook=decode, check=check, later=True, before=size)


SPECS = (EncodingSpec(DELTA, DeltaEncoder(auto=False), DeltaDecoder()),
         EncodingSpec(AUTO, DeltaEncoder(auto=True), DeltaDecoder()))
