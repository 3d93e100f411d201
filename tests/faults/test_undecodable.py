"""A request that does not parse (invalid UTF-8 in a string field) ends INVALID_ARGUMENT, not
gRPC's UNKNOWN, and the service keeps serving."""

from __future__ import annotations

import grpc
import pytest

from pdserve.v1 import kvstore_pb2
from tests.kvstore_support import start_store
from tests.support.credentials import SERVICE_METADATA
from tests.support.procs import SERVING, health


def _with_invalid_utf8(msg, marker: str) -> bytes:
    raw = msg.SerializeToString()
    assert raw.count(marker.encode()) == 1
    return raw.replace(marker.encode(), b"\xff\xfe" * (len(marker) // 2))


def test_invalid_utf8_is_invalid_argument_and_the_store_stays_healthy(shared_redis_url, key_prefix):
    store = start_store(shared_redis_url, key_prefix, device_blocks=4, dram_blocks=4)
    try:
        raw = _with_invalid_utf8(kvstore_pb2.AllocatePutRequest(request_id="ABCDEFGH"), "ABCDEFGH")
        with grpc.insecure_channel(store.address) as ch:
            call = ch.unary_unary("/pdserve.v1.KVStore/AllocatePut", request_serializer=None,
                                  response_deserializer=kvstore_pb2.AllocatePutResponse.FromString)
            with pytest.raises(grpc.RpcError) as err:
                call(raw, timeout=5, metadata=(("pdserve-client-id", "t"), *SERVICE_METADATA))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "UTF-8" in err.value.details()
            streaming = ch.stream_unary("/pdserve.v1.KVStore/PutBytes", request_serializer=None,
                                        response_deserializer=kvstore_pb2.PutBytesResponse.FromString)
            header = kvstore_pb2.PutBytesRequest(header=kvstore_pb2.PutBytesHeader(request_id="ABCDEFGH"))
            with pytest.raises(grpc.RpcError) as err:
                streaming(iter([_with_invalid_utf8(header, "ABCDEFGH")]), timeout=5,
                          metadata=(("pdserve-client-id", "t"), *SERVICE_METADATA))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert health(store.address) == SERVING
    finally:
        store.stop()
