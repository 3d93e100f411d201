"""Request checks shared by the workers' servicers (protobuf in, clear INVALID_ARGUMENT out)."""

from __future__ import annotations

from pdserve import logs
from pdserve.engine.sampling import SamplingParams
from pdserve.errors import InvalidArgument
from pdserve.kv.layout import HashProfile
from pdserve.rpc.convert import require_profile, sampling_from_pb


def request_basics(request_id: str, prompt_ids, sampling_pb, profile_pb, expected: HashProfile,
                   vocab_size: int, max_len: int) -> tuple[list[int], SamplingParams]:
    logs.bind_request_id(request_id)
    if not request_id:
        raise InvalidArgument("request_id is required")
    if profile_pb.model_fingerprint or profile_pb.HasField("layout"):
        require_profile(profile_pb, expected)
    ids = list(prompt_ids)
    if not ids:
        raise InvalidArgument("prompt is empty: give at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    try:
        params = sampling_from_pb(sampling_pb)
    except ValueError as e:
        raise InvalidArgument(str(e)) from e
    if len(ids) + params.max_tokens > max_len:
        raise InvalidArgument(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                              f"context length {max_len}")
    return ids, params
