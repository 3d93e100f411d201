from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DEVICE: _ClassVar[Tier]
    TIER_DRAM: _ClassVar[Tier]

class SlotState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SLOT_STATE_UNSPECIFIED: _ClassVar[SlotState]
    SLOT_STATE_WRITE: _ClassVar[SlotState]
    SLOT_STATE_PRESENT: _ClassVar[SlotState]
    SLOT_STATE_PENDING: _ClassVar[SlotState]
TIER_UNSPECIFIED: Tier
TIER_DEVICE: Tier
TIER_DRAM: Tier
SLOT_STATE_UNSPECIFIED: SlotState
SLOT_STATE_WRITE: SlotState
SLOT_STATE_PRESENT: SlotState
SLOT_STATE_PENDING: SlotState

class SlotList(_message.Message):
    __slots__ = ("addresses", "tiers", "states", "checksums")
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    addresses: bytes
    tiers: bytes
    states: bytes
    checksums: bytes
    def __init__(self, addresses: _Optional[bytes] = ..., tiers: _Optional[bytes] = ..., states: _Optional[bytes] = ..., checksums: _Optional[bytes] = ...) -> None: ...

class Slot(_message.Message):
    __slots__ = ("key", "address", "tier", "state", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    address: int
    tier: Tier
    state: SlotState
    checksum: int
    def __init__(self, key: _Optional[bytes] = ..., address: _Optional[int] = ..., tier: _Optional[_Union[Tier, str]] = ..., state: _Optional[_Union[SlotState, str]] = ..., checksum: _Optional[int] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("segment", "profile", "block_nbytes", "device_capacity_blocks", "dram_capacity_blocks", "device_kind", "unix_address", "node")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_NBYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DRAM_CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    UNIX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    segment: str
    profile: _common_pb2.HashProfile
    block_nbytes: int
    device_capacity_blocks: int
    dram_capacity_blocks: int
    device_kind: str
    unix_address: str
    node: str
    def __init__(self, segment: _Optional[str] = ..., profile: _Optional[_Union[_common_pb2.HashProfile, _Mapping]] = ..., block_nbytes: _Optional[int] = ..., device_capacity_blocks: _Optional[int] = ..., dram_capacity_blocks: _Optional[int] = ..., device_kind: _Optional[str] = ..., unix_address: _Optional[str] = ..., node: _Optional[str] = ...) -> None: ...

class AllocatePutRequest(_message.Message):
    __slots__ = ("profile", "block_hashes", "tail_key", "lease_ms", "request_id", "writer_keeps_copy", "hold_ms")
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TAIL_KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WRITER_KEEPS_COPY_FIELD_NUMBER: _ClassVar[int]
    HOLD_MS_FIELD_NUMBER: _ClassVar[int]
    profile: _common_pb2.HashProfile
    block_hashes: bytes
    tail_key: str
    lease_ms: int
    request_id: str
    writer_keeps_copy: bool
    hold_ms: int
    def __init__(self, profile: _Optional[_Union[_common_pb2.HashProfile, _Mapping]] = ..., block_hashes: _Optional[bytes] = ..., tail_key: _Optional[str] = ..., lease_ms: _Optional[int] = ..., request_id: _Optional[str] = ..., writer_keeps_copy: _Optional[bool] = ..., hold_ms: _Optional[int] = ...) -> None: ...

class AllocatePutResponse(_message.Message):
    __slots__ = ("lease_id", "slots", "lease_deadline_unix_ms", "hold_lease_id")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    HOLD_LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    slots: SlotList
    lease_deadline_unix_ms: int
    hold_lease_id: str
    def __init__(self, lease_id: _Optional[str] = ..., slots: _Optional[_Union[SlotList, _Mapping]] = ..., lease_deadline_unix_ms: _Optional[int] = ..., hold_lease_id: _Optional[str] = ...) -> None: ...

class CommitPutRequest(_message.Message):
    __slots__ = ("lease_id", "block_hashes", "tail_ttl_ms", "checksums", "tail", "tail_checksum")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TAIL_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    TAIL_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    block_hashes: bytes
    tail_ttl_ms: int
    checksums: _containers.RepeatedScalarFieldContainer[int]
    tail: bool
    tail_checksum: int
    def __init__(self, lease_id: _Optional[str] = ..., block_hashes: _Optional[bytes] = ..., tail_ttl_ms: _Optional[int] = ..., checksums: _Optional[_Iterable[int]] = ..., tail: _Optional[bool] = ..., tail_checksum: _Optional[int] = ...) -> None: ...

class CommitPutResponse(_message.Message):
    __slots__ = ("committed", "lease_closed")
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    LEASE_CLOSED_FIELD_NUMBER: _ClassVar[int]
    committed: int
    lease_closed: bool
    def __init__(self, committed: _Optional[int] = ..., lease_closed: _Optional[bool] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("profile", "block_hashes", "tail_key", "lease_ms", "request_id")
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TAIL_KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    profile: _common_pb2.HashProfile
    block_hashes: bytes
    tail_key: str
    lease_ms: int
    request_id: str
    def __init__(self, profile: _Optional[_Union[_common_pb2.HashProfile, _Mapping]] = ..., block_hashes: _Optional[bytes] = ..., tail_key: _Optional[str] = ..., lease_ms: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("lease_id", "slots", "tail", "lease_deadline_unix_ms", "from_cluster")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    FROM_CLUSTER_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    slots: SlotList
    tail: Slot
    lease_deadline_unix_ms: int
    from_cluster: int
    def __init__(self, lease_id: _Optional[str] = ..., slots: _Optional[_Union[SlotList, _Mapping]] = ..., tail: _Optional[_Union[Slot, _Mapping]] = ..., lease_deadline_unix_ms: _Optional[int] = ..., from_cluster: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("profile", "block_hashes", "tail_key", "lease_ms", "request_id")
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TAIL_KEY_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    profile: _common_pb2.HashProfile
    block_hashes: bytes
    tail_key: str
    lease_ms: int
    request_id: str
    def __init__(self, profile: _Optional[_Union[_common_pb2.HashProfile, _Mapping]] = ..., block_hashes: _Optional[bytes] = ..., tail_key: _Optional[str] = ..., lease_ms: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("lease_id", "indices", "slots")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    indices: _containers.RepeatedScalarFieldContainer[int]
    slots: SlotList
    def __init__(self, lease_id: _Optional[str] = ..., indices: _Optional[_Iterable[int]] = ..., slots: _Optional[_Union[SlotList, _Mapping]] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "lease_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    lease_ms: int
    def __init__(self, lease_id: _Optional[str] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("lease_deadline_unix_ms",)
    LEASE_DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    lease_deadline_unix_ms: int
    def __init__(self, lease_deadline_unix_ms: _Optional[int] = ...) -> None: ...

class ReleaseLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "lease_ids")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_id: _Optional[str] = ..., lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseLeaseResponse(_message.Message):
    __slots__ = ("unpinned", "reclaimed", "refused")
    UNPINNED_FIELD_NUMBER: _ClassVar[int]
    RECLAIMED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    unpinned: int
    reclaimed: int
    refused: _containers.RepeatedCompositeFieldContainer[LeaseRefusal]
    def __init__(self, unpinned: _Optional[int] = ..., reclaimed: _Optional[int] = ..., refused: _Optional[_Iterable[_Union[LeaseRefusal, _Mapping]]] = ...) -> None: ...

class LeaseRefusal(_message.Message):
    __slots__ = ("lease_id", "code", "message")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    code: str
    message: str
    def __init__(self, lease_id: _Optional[str] = ..., code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class PutBytesHeader(_message.Message):
    __slots__ = ("profile", "block_hashes", "tail_key", "tail_lease_ms", "request_id")
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TAIL_KEY_FIELD_NUMBER: _ClassVar[int]
    TAIL_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    profile: _common_pb2.HashProfile
    block_hashes: bytes
    tail_key: str
    tail_lease_ms: int
    request_id: str
    def __init__(self, profile: _Optional[_Union[_common_pb2.HashProfile, _Mapping]] = ..., block_hashes: _Optional[bytes] = ..., tail_key: _Optional[str] = ..., tail_lease_ms: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class PutBytesRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PutBytesHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PutBytesHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ReportCorruptRequest(_message.Message):
    __slots__ = ("lease_id", "block_hashes", "tail")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    block_hashes: bytes
    tail: bool
    def __init__(self, lease_id: _Optional[str] = ..., block_hashes: _Optional[bytes] = ..., tail: _Optional[bool] = ...) -> None: ...

class ReportCorruptResponse(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    def __init__(self, dropped: _Optional[int] = ...) -> None: ...

class PutBytesResponse(_message.Message):
    __slots__ = ("written", "already_present", "pending")
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    ALREADY_PRESENT_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    written: int
    already_present: int
    pending: int
    def __init__(self, written: _Optional[int] = ..., already_present: _Optional[int] = ..., pending: _Optional[int] = ...) -> None: ...

class GetBytesRequest(_message.Message):
    __slots__ = ("profile", "block_hashes", "tail_key", "request_id")
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    TAIL_KEY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    profile: _common_pb2.HashProfile
    block_hashes: bytes
    tail_key: str
    request_id: str
    def __init__(self, profile: _Optional[_Union[_common_pb2.HashProfile, _Mapping]] = ..., block_hashes: _Optional[bytes] = ..., tail_key: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...

class GetBytesResponse(_message.Message):
    __slots__ = ("num_blocks", "has_tail", "data")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HAS_TAIL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    has_tail: bool
    data: bytes
    def __init__(self, num_blocks: _Optional[int] = ..., has_tail: _Optional[bool] = ..., data: _Optional[bytes] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "capacity_blocks", "capacity_bytes", "used_blocks", "pinned_blocks", "hits", "evictions", "promotions", "duplicate_blocks")
    TIER_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    capacity_blocks: int
    capacity_bytes: int
    used_blocks: int
    pinned_blocks: int
    hits: int
    evictions: int
    promotions: int
    duplicate_blocks: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., capacity_blocks: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., used_blocks: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., hits: _Optional[int] = ..., evictions: _Optional[int] = ..., promotions: _Optional[int] = ..., duplicate_blocks: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "hits", "misses", "bytes_written", "bytes_read", "active_leases", "watchers", "redis_connected", "corrupt_blocks", "fenced_blocks", "cluster", "calls")
    class CallsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    WATCHERS_FIELD_NUMBER: _ClassVar[int]
    REDIS_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FENCED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    hits: int
    misses: int
    bytes_written: int
    bytes_read: int
    active_leases: int
    watchers: int
    redis_connected: bool
    corrupt_blocks: int
    fenced_blocks: int
    cluster: ClusterStats
    calls: _containers.ScalarMap[str, int]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., bytes_written: _Optional[int] = ..., bytes_read: _Optional[int] = ..., active_leases: _Optional[int] = ..., watchers: _Optional[int] = ..., redis_connected: _Optional[bool] = ..., corrupt_blocks: _Optional[int] = ..., fenced_blocks: _Optional[int] = ..., cluster: _Optional[_Union[ClusterStats, _Mapping]] = ..., calls: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ClusterStats(_message.Message):
    __slots__ = ("connected", "spilled", "put_failures", "spill_dropped", "fetched", "fetch_misses", "fetch_timeouts", "corrupt", "unreachable", "fetch_errors")
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    SPILLED_FIELD_NUMBER: _ClassVar[int]
    PUT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    SPILL_DROPPED_FIELD_NUMBER: _ClassVar[int]
    FETCHED_FIELD_NUMBER: _ClassVar[int]
    FETCH_MISSES_FIELD_NUMBER: _ClassVar[int]
    FETCH_TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    FETCH_ERRORS_FIELD_NUMBER: _ClassVar[int]
    connected: bool
    spilled: int
    put_failures: int
    spill_dropped: int
    fetched: int
    fetch_misses: int
    fetch_timeouts: int
    corrupt: int
    unreachable: int
    fetch_errors: int
    def __init__(self, connected: _Optional[bool] = ..., spilled: _Optional[int] = ..., put_failures: _Optional[int] = ..., spill_dropped: _Optional[int] = ..., fetched: _Optional[int] = ..., fetch_misses: _Optional[int] = ..., fetch_timeouts: _Optional[int] = ..., corrupt: _Optional[int] = ..., unreachable: _Optional[int] = ..., fetch_errors: _Optional[int] = ...) -> None: ...
