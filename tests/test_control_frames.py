"""The control socket's framing (pdserve/kv/control_frames.py): frames cut out of a byte stream
however it arrives, and the slot columns an answer carries. Pure logic: no store, no socket."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.kv.control_frames import FrameError, FrameReader, frame
from pdserve.v1 import kvstore_pb2 as pb


def _requests(n: int) -> list[pb.ControlRequest]:
    return [pb.ControlRequest(call_id=i, release_lease=pb.ReleaseLeaseRequest(lease_id=f"r{i}" * (i % 5 + 1)))
            for i in range(1, n + 1)]


@pytest.mark.parametrize("chunk", [1, 3, 4, 5, 17, 1 << 20])
def test_frames_come_out_whole_and_in_order_however_the_bytes_are_cut(chunk):
    messages = _requests(40)
    stream = b"".join(frame(m) for m in messages)
    reader = FrameReader()
    out = []
    for i in range(0, len(stream), chunk):
        out += [pb.ControlRequest.FromString(p) for p in reader.feed(stream[i : i + chunk])]
    assert out == messages
    assert reader.feed(b"") == []  # nothing left over


def test_a_read_of_one_whole_frame_comes_back_uncopied_and_the_stream_goes_on():
    reader = FrameReader()
    data = frame(pb.ControlRequest(call_id=3, release_lease=dict(lease_id="r1")))
    [payload] = reader.feed(data)
    assert isinstance(payload, memoryview) and payload.obj is data  # a view of the read's bytes
    assert pb.ControlRequest.FromString(payload).release_lease.lease_id == "r1"
    second = frame(pb.ControlRequest(call_id=4))
    assert reader.feed(second[:3]) == [] and reader.feed(second[3:] + data[:2]) == [second[4:]]
    assert [pb.ControlRequest.FromString(p).call_id for p in reader.feed(data[2:])] == [3]


def test_an_empty_message_is_a_frame_of_its_own():
    reader = FrameReader()
    assert reader.feed(frame(pb.ControlRequest()) + frame(pb.ControlRequest(call_id=7))[:5]) == [b""]
    assert [pb.ControlRequest.FromString(p).call_id for p in reader.feed(frame(pb.ControlRequest(call_id=7))[5:])] \
        == [7]


def test_a_frame_over_the_limit_is_refused_from_its_header():
    reader = FrameReader(max_bytes=100)
    assert reader.feed((100).to_bytes(4, "little")) == []  # at the limit: waits for the payload
    with pytest.raises(FrameError, match="a frame of 101 bytes, over the limit of 100"):
        FrameReader(max_bytes=100).feed((101).to_bytes(4, "little"))


def test_an_answers_slots_stay_columns_and_read_as_slot_infos():
    from pdserve.kv.store_client import SlotColumns, SlotInfo, slots_from_pb

    m = pb.SlotList(addresses=np.array([4096, 8192, 65536], "<u8").tobytes(),
                    tiers=bytes([pb.TIER_DEVICE, pb.TIER_DRAM, pb.TIER_DEVICE]),
                    states=bytes([pb.SLOT_STATE_WRITE, pb.SLOT_STATE_PRESENT, pb.SLOT_STATE_PENDING]))
    slots = slots_from_pb(m)
    assert len(slots) == 3
    assert slots[1] == SlotInfo(8192, pb.TIER_DRAM, pb.SLOT_STATE_PRESENT) and slots[-1].address == 65536
    tail = slots[1:]
    assert isinstance(tail, SlotColumns) and tail.addresses.tolist() == [8192, 65536]
    assert (tail.tiers, tail.states) == (bytes([pb.TIER_DRAM, pb.TIER_DEVICE]),
                                         bytes([pb.SLOT_STATE_PRESENT, pb.SLOT_STATE_PENDING]))
    assert type(slots[0].address) is int and [s.address for s in slots] == [4096, 8192, 65536]
    assert [s.state for s in slots] == [pb.SLOT_STATE_WRITE, pb.SLOT_STATE_PRESENT, pb.SLOT_STATE_PENDING]
    assert slots.states.count(pb.SLOT_STATE_WRITE) == 1
    with pytest.raises(ValueError, match=r"malformed slot list from the store: 16 bytes of addresses \(8 each\), "
                                         "3 tiers, 3 states"):
        slots_from_pb(pb.SlotList(addresses=m.addresses[:16], tiers=m.tiers, states=m.states))
