"""A minimal writer of Perfetto's binary trace format (.pftrace): protobuf wire encoding of the few messages a
track-event trace needs, by hand (the API stays free of generated code it does not otherwise need).

Field numbers are Perfetto's (github.com/google/perfetto, protos/perfetto/trace/...):
  trace.proto                          Trace.packet = 1 (repeated TracePacket)
  trace_packet.proto                   TracePacket.timestamp = 8, .track_event = 11, .track_descriptor = 60,
                                       .trusted_packet_sequence_id = 10, .sequence_flags = 13
                                       (SEQ_INCREMENTAL_STATE_CLEARED = 1)
  track_event/track_descriptor.proto   TrackDescriptor.uuid = 1, .name = 2, .parent_uuid = 5, .counter = 8
  track_event/counter_descriptor.proto CounterDescriptor.unit = 3 (UNIT_COUNT = 2), .unit_multiplier = 4
  track_event/track_event.proto        TrackEvent.type = 9 (TYPE_SLICE_BEGIN = 1, TYPE_SLICE_END = 2,
                                       TYPE_INSTANT = 3, TYPE_COUNTER = 4), .track_uuid = 11, .name = 23,
                                       .categories = 22, .counter_value = 30, .double_counter_value = 44,
                                       .debug_annotations = 4
  track_event/debug_annotation.proto   DebugAnnotation.name = 10, .int_value = 4, .double_value = 5,
                                       .string_value = 6
Timestamps are nanoseconds (Unix epoch, on the trace's default clock: the UI shows them relative to the first).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

SLICE_BEGIN, SLICE_END, INSTANT, COUNTER = 1, 2, 3, 4
UNIT_COUNT = 2
SEQUENCE_ID = 1  # every packet is on one writer sequence
SEQ_INCREMENTAL_STATE_CLEARED = 1

Annotation = tuple[str, int | float | str]


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int64 negatives: ten-byte two's complement, as protobuf does
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _int(field: int, value: int) -> bytes:
    return _key(field, 0) + _varint(value)


def _double(field: int, value: float) -> bytes:
    return _key(field, 1) + struct.pack("<d", value)


def _bytes(field: int, value: bytes) -> bytes:
    return _key(field, 2) + _varint(len(value)) + value


def _str(field: int, value: str) -> bytes:
    return _bytes(field, value.encode())


def _annotation(name: str, value: int | float | str) -> bytes:
    if isinstance(value, bool) or isinstance(value, int):
        body = _int(4, int(value))
    elif isinstance(value, float):
        body = _double(5, value)
    else:
        body = _str(6, str(value))
    return _str(10, name) + body


class TraceWriter:
    """Appends TracePackets; `bytes()` is the Trace (each packet a `packet = 1` field, so the file is a Trace)."""

    def __init__(self) -> None:
        self._out = bytearray()
        self._first = True

    def _packet(self, body: bytes, timestamp_ns: int | None = None) -> None:
        fields = _int(10, SEQUENCE_ID)
        if self._first:  # a reader may assume nothing about the sequence before this packet
            fields += _int(13, SEQ_INCREMENTAL_STATE_CLEARED)
            self._first = False
        if timestamp_ns is not None:
            fields += _int(8, timestamp_ns)
        self._out += _bytes(1, fields + body)

    def track(self, uuid: int, name: str, parent: int | None = None) -> None:
        body = _int(1, uuid) + _str(2, name) + (_int(5, parent) if parent is not None else b"")
        self._packet(_bytes(60, body))

    def counter_track(self, uuid: int, name: str, parent: int | None = None, unit_multiplier: int = 0) -> None:
        counter = _int(3, UNIT_COUNT) + (_int(4, unit_multiplier) if unit_multiplier else b"")
        body = _int(1, uuid) + _str(2, name) + (_int(5, parent) if parent is not None else b"") + _bytes(8, counter)
        self._packet(_bytes(60, body))

    def begin(self, track: int, timestamp_ns: int, name: str, annotations: Iterable[Annotation] = (),
              category: str | None = None) -> None:
        body = _int(9, SLICE_BEGIN) + _int(11, track) + _str(23, name)
        if category:
            body += _str(22, category)
        for key, value in annotations:
            body += _bytes(4, _annotation(key, value))
        self._packet(_bytes(11, body), timestamp_ns)

    def end(self, track: int, timestamp_ns: int) -> None:
        self._packet(_bytes(11, _int(9, SLICE_END) + _int(11, track)), timestamp_ns)

    def counter(self, track: int, timestamp_ns: int, value: float) -> None:
        field = _int(30, int(value)) if float(value).is_integer() else _double(44, float(value))
        self._packet(_bytes(11, _int(9, COUNTER) + _int(11, track) + field), timestamp_ns)

    def __bytes__(self) -> bytes:
        return bytes(self._out)

    def __len__(self) -> int:
        return len(self._out)
