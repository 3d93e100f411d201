from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class RouteDecision(_message.Message):
    __slots__ = ("prefill_worker", "decode_worker", "policy", "expected_hit_tokens", "estimated_ttft_ms", "colocated", "best_hit_tokens")
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ESTIMATED_TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_FIELD_NUMBER: _ClassVar[int]
    BEST_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prefill_worker: str
    decode_worker: str
    policy: str
    expected_hit_tokens: int
    estimated_ttft_ms: float
    colocated: bool
    best_hit_tokens: int
    def __init__(self, prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., policy: _Optional[str] = ..., expected_hit_tokens: _Optional[int] = ..., estimated_ttft_ms: _Optional[float] = ..., colocated: _Optional[bool] = ..., best_hit_tokens: _Optional[int] = ...) -> None: ...

class GenerateSummary(_message.Message):
    __slots__ = ("request_id", "finish_reason", "usage", "timings", "route")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    timings: _common_pb2.Timings
    route: RouteDecision
    def __init__(self, request_id: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ..., route: _Optional[_Union[RouteDecision, _Mapping]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token", "summary", "tokens")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    token: _common_pb2.TokenEvent
    summary: GenerateSummary
    tokens: _common_pb2.TokenEvents
    def __init__(self, token: _Optional[_Union[_common_pb2.TokenEvent, _Mapping]] = ..., summary: _Optional[_Union[GenerateSummary, _Mapping]] = ..., tokens: _Optional[_Union[_common_pb2.TokenEvents, _Mapping]] = ...) -> None: ...

class GenerateResult(_message.Message):
    __slots__ = ("text", "tokens", "summary")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    text: str
    tokens: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenEvent]
    summary: GenerateSummary
    def __init__(self, text: _Optional[str] = ..., tokens: _Optional[_Iterable[_Union[_common_pb2.TokenEvent, _Mapping]]] = ..., summary: _Optional[_Union[GenerateSummary, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("address", "role", "healthy", "load", "refused_reason", "device", "kv_path")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    REFUSED_REASON_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    KV_PATH_FIELD_NUMBER: _ClassVar[int]
    address: str
    role: _common_pb2.WorkerRole
    healthy: bool
    load: _common_pb2.WorkerLoad
    refused_reason: str
    device: str
    kv_path: str
    def __init__(self, address: _Optional[str] = ..., role: _Optional[_Union[_common_pb2.WorkerRole, str]] = ..., healthy: _Optional[bool] = ..., load: _Optional[_Union[_common_pb2.WorkerLoad, _Mapping]] = ..., refused_reason: _Optional[str] = ..., device: _Optional[str] = ..., kv_path: _Optional[str] = ...) -> None: ...

class HitRates(_message.Message):
    __slots__ = ("scope", "hit_tokens", "lookup_tokens", "ratio")
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RATIO_FIELD_NUMBER: _ClassVar[int]
    scope: str
    hit_tokens: int
    lookup_tokens: int
    ratio: float
    def __init__(self, scope: _Optional[str] = ..., hit_tokens: _Optional[int] = ..., lookup_tokens: _Optional[int] = ..., ratio: _Optional[float] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("workers", "redis_connected", "routing", "hit_rates", "store", "prefix_index")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    REDIS_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    ROUTING_FIELD_NUMBER: _ClassVar[int]
    HIT_RATES_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_INDEX_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    redis_connected: bool
    routing: str
    hit_rates: _containers.RepeatedCompositeFieldContainer[HitRates]
    store: StoreStatus
    prefix_index: str
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., redis_connected: _Optional[bool] = ..., routing: _Optional[str] = ..., hit_rates: _Optional[_Iterable[_Union[HitRates, _Mapping]]] = ..., store: _Optional[_Union[StoreStatus, _Mapping]] = ..., prefix_index: _Optional[str] = ...) -> None: ...

class StoreStatus(_message.Message):
    __slots__ = ("address", "reachable", "device_used_blocks", "device_capacity_blocks", "dram_used_blocks", "dram_capacity_blocks", "hits", "misses", "active_leases")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REACHABLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAM_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAM_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    address: str
    reachable: bool
    device_used_blocks: int
    device_capacity_blocks: int
    dram_used_blocks: int
    dram_capacity_blocks: int
    hits: int
    misses: int
    active_leases: int
    def __init__(self, address: _Optional[str] = ..., reachable: _Optional[bool] = ..., device_used_blocks: _Optional[int] = ..., device_capacity_blocks: _Optional[int] = ..., dram_used_blocks: _Optional[int] = ..., dram_capacity_blocks: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., active_leases: _Optional[int] = ...) -> None: ...
