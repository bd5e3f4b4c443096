"""The encodings this process can send and receive, by name.

Built in: ``"full"`` (:mod:`weightsync.encodings.seam`) and ``"delta"`` and ``"auto"``
(:mod:`weightsync.encodings.delta`, imported when first named). Others are registered from outside
(``weightsync.extend.register_encoding``), on both ends. The seam's types live in
:mod:`~weightsync.encodings.seam`, which imports neither this registry nor the delta encodings:
no import circle.
"""

from __future__ import annotations

import threading

from weightsync.encodings.seam import AUTO, DELTA, FULL, FULL_SPEC, Decoder, Encoder, EncodingSpec

_BUILT_IN_LATER = (DELTA, AUTO)  # weightsync.encodings.delta, imported when first named
_registered: dict[str, EncodingSpec] = {FULL: FULL_SPEC}
_lock = threading.Lock()


def _lookup(name: str) -> EncodingSpec:
    """Under ``_lock``: the spec of ``name`` (KeyError when unknown); the delta encodings are built
    in, loaded on first use."""
    if name in _BUILT_IN_LATER and name not in _registered:
        from weightsync.encodings import delta

        for spec in delta.SPECS:
            _registered[spec.name] = spec
    return _registered[name]


def register_encoding(spec: EncodingSpec) -> None:
    """Make ``spec.name`` an encoding this process can send and receive (``Publisher(encoding=)``)."""
    if spec.name in (FULL, *_BUILT_IN_LATER):
        raise ValueError(f"encoding {spec.name!r} is built in")
    for end, role, members in ((spec.encoder, "Encoder", ("plan", "share")), (spec.decoder, "Decoder", ("plan",))):
        missing = [m for m in members if not callable(getattr(end, m, None))]
        if missing:
            raise TypeError(f"encoding {spec.name!r}: its {role.lower()} {type(end).__name__} has no {missing} "
                            f"(subclass weightsync.extend.{role} for the optional ones' defaults)")
    with _lock:
        _registered[spec.name] = spec


def unregister_encoding(name: str) -> None:
    if name not in (FULL, *_BUILT_IN_LATER):
        with _lock:
            _registered.pop(name, None)


def known(name: str) -> bool:
    with _lock:
        try:
            _lookup(name)
        except KeyError:
            return False
        return True


def encoder(name: str) -> Encoder:
    with _lock:
        return _lookup(name).encoder


def decoder(name: str) -> Decoder:
    """KeyError for an encoding this process does not have (the member refuses the version)."""
    with _lock:
        return _lookup(name).decoder


