from pdserve.v1 import common_pb2 as _common_pb2
from pdserve.v1 import prefill_pb2 as _prefill_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DecodeMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DECODE_MODE_UNSPECIFIED: _ClassVar[DecodeMode]
    DECODE_MODE_DISAGGREGATED: _ClassVar[DecodeMode]
    DECODE_MODE_COLOCATED: _ClassVar[DecodeMode]
DECODE_MODE_UNSPECIFIED: DecodeMode
DECODE_MODE_DISAGGREGATED: DecodeMode
DECODE_MODE_COLOCATED: DecodeMode

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "mode", "profile", "tail_key", "prefill_timeout_ms", "stream_interval")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    TAIL_KEY_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    mode: DecodeMode
    profile: _common_pb2.HashProfile
    tail_key: str
    prefill_timeout_ms: int
    stream_interval: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., mode: _Optional[_Union[DecodeMode, str]] = ..., profile: _Optional[_Union[_common_pb2.HashProfile, _Mapping]] = ..., tail_key: _Optional[str] = ..., prefill_timeout_ms: _Optional[int] = ..., stream_interval: _Optional[int] = ...) -> None: ...

class Admitted(_message.Message):
    __slots__ = ("reserved_blocks", "local_hit_blocks")
    RESERVED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    reserved_blocks: int
    local_hit_blocks: int
    def __init__(self, reserved_blocks: _Optional[int] = ..., local_hit_blocks: _Optional[int] = ...) -> None: ...

class DecodeDone(_message.Message):
    __slots__ = ("finish_reason", "usage", "timings")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    timings: _common_pb2.Timings
    def __init__(self, finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., timings: _Optional[_Union[_common_pb2.Timings, _Mapping]] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("admitted", "token", "done", "tokens")
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    admitted: Admitted
    token: _common_pb2.TokenEvent
    done: DecodeDone
    tokens: _common_pb2.TokenEvents
    def __init__(self, admitted: _Optional[_Union[Admitted, _Mapping]] = ..., token: _Optional[_Union[_common_pb2.TokenEvent, _Mapping]] = ..., done: _Optional[_Union[DecodeDone, _Mapping]] = ..., tokens: _Optional[_Union[_common_pb2.TokenEvents, _Mapping]] = ...) -> None: ...

class FirstTokenRequest(_message.Message):
    __slots__ = ("request_id", "prefill")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prefill: _prefill_pb2.PrefillResponse
    def __init__(self, request_id: _Optional[str] = ..., prefill: _Optional[_Union[_prefill_pb2.PrefillResponse, _Mapping]] = ...) -> None: ...

class FirstTokenResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
