"""Protobuf <-> dataclass conversion for the common messages. Protobuf stops at the servicers."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import FinishReason
from pdserve.errors import InvalidArgument
from pdserve.kv.hashing import HASH_BYTES
from pdserve.kv.layout import HashProfile, KVLayout
from pdserve.v1 import common_pb2 as pb

_FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}
_FINISH_BACK = {v: k for k, v in _FINISH.items()}


def profile_to_pb(p: HashProfile) -> pb.HashProfile:
    lay = p.layout
    return pb.HashProfile(model_fingerprint=p.model_fingerprint, layout=pb.KVLayout(
        num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads, block_size=lay.block_size,
        head_dim=lay.head_dim, dtype=lay.dtype))


def profile_from_pb(m: pb.HashProfile) -> HashProfile:
    if not m.model_fingerprint or not m.HasField("layout"):
        raise InvalidArgument("hash profile missing: give model_fingerprint and layout")
    lay = m.layout
    try:
        layout = KVLayout(lay.num_layers, lay.num_kv_heads, lay.block_size, lay.head_dim, lay.dtype)
    except ValueError as e:
        raise InvalidArgument(f"bad KV layout: {e}") from e
    return HashProfile(m.model_fingerprint, layout)


def require_profile(m: pb.HashProfile, expected: HashProfile) -> None:
    reason = expected.mismatch(profile_from_pb(m))
    if reason:
        raise InvalidArgument(f"hash profile mismatch: {reason}")


_PACKED_HASH = np.dtype((np.uint64, (2,)))  # one hash as the store keys it: frombuffer gives [n, 2]


def hashes_from_pb(raw: bytes, limit: int) -> np.ndarray:
    """A request's block hashes (one bytes field, 16 bytes each) as [n, 2] uint64, no copy."""
    n, extra = divmod(len(raw), HASH_BYTES)
    if extra:
        raise InvalidArgument(f"malformed block hashes: {len(raw)} bytes is not a whole number of "
                              f"{HASH_BYTES}-byte hashes (hash {n} has {extra} bytes)")
    if n > limit:
        raise InvalidArgument(f"too many blocks in one request: {n} > {limit}")
    return np.frombuffer(raw, _PACKED_HASH)  # [n, 2]


def hashes_to_pb(hashes: Sequence[bytes]) -> bytes:
    """Block hashes as a request carries them: one bytes field, 16 bytes each."""
    data = b"".join(hashes)
    if len(data) != HASH_BYTES * len(hashes):
        bad = next(i for i, h in enumerate(hashes) if len(h) != HASH_BYTES)
        raise ValueError(f"block hash {bad} has {len(hashes[bad])} bytes, expected {HASH_BYTES}")
    return data


def sampling_from_pb(m: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(
        max_tokens=m.max_tokens, temperature=m.temperature, top_k=m.top_k,
        top_p=m.top_p if m.top_p != 0 else 1.0, seed=m.seed if m.HasField("seed") else None,
        stop_token_ids=tuple(m.stop_token_ids), ignore_eos=m.ignore_eos)


def sampling_to_pb(p: SamplingParams) -> pb.SamplingParams:
    m = pb.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                          stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos)
    if p.seed is not None:
        m.seed = p.seed
    return m


def finish_to_pb(reason: FinishReason | None) -> int:
    return _FINISH[reason]


def finish_from_pb(value: int) -> FinishReason | None:
    return _FINISH_BACK[value]
