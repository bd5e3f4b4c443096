"""The encoding seam, driven by an encoding registered from outside (tests/xor_encoding.py).

Group members receive the version XORed on the wire and decode it before their digest;
same-host members read the staged segment as it is; both end bit-exact. A decoder that gets
one bit wrong is caught by the digest over what it decoded, and never exposes a version.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

import weightsync as ws
from tests import xor_encoding
from tests.statedicts import digest, mixed_state_dict
from weightsync.extend import (
    EncodingSpec,
    PlaneSpec,
    register_encoding,
    register_plane,
    unregister_encoding,
    unregister_plane,
)
from weightsync.planes.sendside import SendSide
from weightsync.planes.shm import plane as shm

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]

FAST = {"timeout": 5.0, "heartbeat_interval": 0.25, "bucket_bytes": 1 << 16}


@pytest.fixture
def xor() -> Iterator[None]:
    register_encoding(xor_encoding.XOR)
    register_encoding(xor_encoding.BROKEN)
    yield
    unregister_encoding(xor_encoding.XOR.name)
    unregister_encoding(xor_encoding.BROKEN.name)


async def test_an_unknown_encoding_is_refused_at_once() -> None:
    with pytest.raises(ValueError, match="neither built in nor registered"):
        ws.Publisher("enc", encoding="zstd-someday")


async def test_an_encoder_or_a_send_part_without_a_member_of_its_seam_is_refused_naming_it() -> None:
    """The seams' optional members are declared with defaults a plug-in inherits by subclassing
    (``Encoder``, ``SendPart``); one written without them is refused where it is plugged in,
    naming what it lacks, not found out mid-version."""

    class NoShare:  # an encoder written against the seam's old shape: plan only, not a subclass
        def plan(self, out: object) -> object:
            raise AssertionError("never asked")

    with pytest.raises(TypeError, match=r"encoder NoShare has no \['share'\].*weightsync\.extend\.Encoder"):
        register_encoding(EncodingSpec("no-share", NoShare(), xor_encoding.XorDecoder()))
    with pytest.raises(ValueError, match="neither built in nor registered"):
        ws.Publisher("enc", encoding="no-share")

    class Bare:  # a send part without the optional members (reads_in_place, wire_of)
        name, in_group, moves_alone, drives, plane = "bare", False, True, False, None

        def admit(self, member: str, want: object) -> None: ...
        def forget(self, member: str) -> None: ...
        def prepare(self, out: object, members: object) -> object: ...
        def move(self, out: object, members: object) -> None: ...
        def digests(self) -> dict[str, list[int]]: return {}
        def close(self) -> None: ...

    register_plane(PlaneSpec("bare", send_part=lambda _context: Bare(), member_plane=lambda _context: None))
    try:
        with pytest.raises(TypeError, match=r"send part Bare has no \['reads_in_place', 'refusal', 'wire_of'\]"):
            SendSide(("bare",), None)
    finally:
        unregister_plane("bare")


async def test_an_encoded_version_is_decoded_bit_exact_on_every_plane(xor: None) -> None:
    transports = ["group", "group"] + (["shm"] if shm.available() else [])
    async with ws.Publisher("enc", encoding="xor-test", **FAST) as pub:
        subs = [ws.Subscriber("enc", address=pub.address, member_id=f"m{i}", timeout=5.0, transport=t)
                for i, t in enumerate(transports)]
        await asyncio.gather(*(s.start() for s in subs))
        try:
            await pub.wait_subscribers(len(subs), timeout=20)
            encoded, decoded = xor_encoding.Counts.encoded, xor_encoding.Counts.decoded
            for version in range(3):
                sd = mixed_state_dict(version, mib=0.5)
                report = await (await pub.put(sd, version=version))
                assert set(report.members) == {s.member_id for s in subs}
                for sub in subs:
                    weights = await sub.get(min_version=version, timeout=10)
                    assert {k: digest(v) for k, v in weights.items()} == {k: digest(v) for k, v in sd.items()}
            # the group's buckets went XORed (encoded once per bucket for the whole group) and both
            # group members decoded them; the same-host member read the staged segment as it is
            assert xor_encoding.Counts.encoded > encoded
            assert xor_encoding.Counts.decoded - decoded == 2 * (xor_encoding.Counts.encoded - encoded)
        finally:
            await asyncio.gather(*(s.aclose() for s in subs))


async def test_a_wrong_decode_is_caught_by_the_digest_and_never_readable(xor: None) -> None:
    async with ws.Publisher("enc", encoding="xor-test-broken", **FAST) as pub:
        async with ws.Subscriber("enc", address=pub.address, member_id="m0", timeout=5.0,
                                 transport="group") as sub:
            await pub.wait_subscribers(1, timeout=20)
            sd = mixed_state_dict(0, mib=0.5)
            report = await (await pub.put(sd, version=0))
            # the decoded bytes did not match, so they were never made readable; the publisher sent
            # the same version again in full, in the same generation, and that is what the member holds
            stats = sub.statistics()
            assert stats.checksum_failures >= 1 and stats.versions_received == 1
            assert report.members == ("m0",) and report.encodings == {"m0": "full"}
            assert pub.statistics().delta_fallbacks == 1
            weights = await sub.get(min_version=0, timeout=10)
            assert {k: digest(v) for k, v in weights.items()} == {k: digest(v) for k, v in sd.items()}
