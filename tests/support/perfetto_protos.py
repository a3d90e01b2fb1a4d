"""Perfetto's trace messages as the protobuf runtime reads them, for tests that parse a .pftrace back: a trimmed
schema of protos/perfetto/trace/ (github.com/google/perfetto) with Perfetto's own message, field and enum names and
numbers, declared here as a FileDescriptorProto (protoc is not a dependency) and compiled by the protobuf package's
descriptor pool. Fields this schema leaves out are kept by the parser as unknown fields.

Sources (message: fields used):
  trace.proto                          Trace: packet = 1
  trace_packet.proto                   TracePacket: timestamp = 8, trusted_packet_sequence_id = 10,
                                       track_event = 11, sequence_flags = 13, track_descriptor = 60
  track_event/track_descriptor.proto   TrackDescriptor: uuid = 1, name = 2, parent_uuid = 5, counter = 8
  track_event/counter_descriptor.proto CounterDescriptor: type = 1, categories = 2, unit = 3, unit_multiplier = 4,
                                       is_incremental = 5 (Unit: UNIT_UNSPECIFIED 0, UNIT_TIME_NS 1, UNIT_COUNT 2,
                                       UNIT_SIZE_BYTES 3)
  track_event/track_event.proto        TrackEvent: debug_annotations = 4, type = 9 (Type: TYPE_UNSPECIFIED 0,
                                       TYPE_SLICE_BEGIN 1, TYPE_SLICE_END 2, TYPE_INSTANT 3, TYPE_COUNTER 4),
                                       name_iid = 10, track_uuid = 11, categories = 22, name = 23,
                                       counter_value = 30, double_counter_value = 44
  track_event/debug_annotation.proto   DebugAnnotation: name_iid = 1, bool_value = 2, uint_value = 3,
                                       int_value = 4, double_value = 5, string_value = 6, name = 10
"""

from __future__ import annotations

from functools import cache
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

F = descriptor_pb2.FieldDescriptorProto
OPTIONAL, REPEATED = F.LABEL_OPTIONAL, F.LABEL_REPEATED
TYPES = {"uint64": F.TYPE_UINT64, "int64": F.TYPE_INT64, "uint32": F.TYPE_UINT32, "int32": F.TYPE_INT32,
         "string": F.TYPE_STRING, "bool": F.TYPE_BOOL, "double": F.TYPE_DOUBLE}

# message -> [(label, type or message / enum name, field name, number, oneof index or None)]
MESSAGES: dict[str, list[tuple[int, str, str, int, int | None]]] = {
    "Trace": [(REPEATED, ".perfetto.protos.TracePacket", "packet", 1, None)],
    "TracePacket": [(OPTIONAL, "uint64", "timestamp", 8, None),
                    (OPTIONAL, ".perfetto.protos.TrackEvent", "track_event", 11, 0),
                    (OPTIONAL, ".perfetto.protos.TrackDescriptor", "track_descriptor", 60, 0),
                    (OPTIONAL, "uint32", "trusted_packet_sequence_id", 10, 1),
                    (OPTIONAL, "uint32", "sequence_flags", 13, None)],
    "TrackDescriptor": [(OPTIONAL, "uint64", "uuid", 1, None), (OPTIONAL, "uint64", "parent_uuid", 5, None),
                        (OPTIONAL, "string", "name", 2, None),
                        (OPTIONAL, ".perfetto.protos.CounterDescriptor", "counter", 8, None)],
    "CounterDescriptor": [(OPTIONAL, "enum:.perfetto.protos.CounterDescriptor.Unit", "unit", 3, None),
                          (REPEATED, "string", "categories", 2, None),
                          (OPTIONAL, "int64", "unit_multiplier", 4, None),
                          (OPTIONAL, "bool", "is_incremental", 5, None)],
    "TrackEvent": [(REPEATED, "string", "categories", 22, None), (OPTIONAL, "uint64", "name_iid", 10, 0),
                   (OPTIONAL, "string", "name", 23, 0),
                   (OPTIONAL, "enum:.perfetto.protos.TrackEvent.Type", "type", 9, None),
                   (OPTIONAL, "uint64", "track_uuid", 11, None), (OPTIONAL, "int64", "counter_value", 30, 1),
                   (OPTIONAL, "double", "double_counter_value", 44, 1),
                   (REPEATED, ".perfetto.protos.DebugAnnotation", "debug_annotations", 4, None)],
    "DebugAnnotation": [(OPTIONAL, "uint64", "name_iid", 1, 0), (OPTIONAL, "string", "name", 10, 0),
                        (OPTIONAL, "bool", "bool_value", 2, 1), (OPTIONAL, "uint64", "uint_value", 3, 1),
                        (OPTIONAL, "int64", "int_value", 4, 1), (OPTIONAL, "double", "double_value", 5, 1),
                        (OPTIONAL, "string", "string_value", 6, 1)],
}
ONEOFS = {"TracePacket": ["data", "optional_trusted_packet_sequence_id"], "TrackEvent": ["name_field",
          "counter_value_field"], "DebugAnnotation": ["name_field", "value"]}
ENUMS = {"CounterDescriptor": ("Unit", {"UNIT_UNSPECIFIED": 0, "UNIT_TIME_NS": 1, "UNIT_COUNT": 2,
                                        "UNIT_SIZE_BYTES": 3}),
         "TrackEvent": ("Type", {"TYPE_UNSPECIFIED": 0, "TYPE_SLICE_BEGIN": 1, "TYPE_SLICE_END": 2,
                                 "TYPE_INSTANT": 3, "TYPE_COUNTER": 4})}


@cache
def trace_class() -> Any:
    """The perfetto.protos.Trace message class."""
    file = descriptor_pb2.FileDescriptorProto(name="skyrl_tx_tests/perfetto_trace.proto", package="perfetto.protos",
                                              syntax="proto2")
    for name, fields in MESSAGES.items():
        message = file.message_type.add(name=name)
        for oneof in ONEOFS.get(name, []):
            message.oneof_decl.add(name=oneof)
        if name in ENUMS:
            enum_name, values = ENUMS[name]
            enum = message.enum_type.add(name=enum_name)
            for value_name, number in values.items():
                enum.value.add(name=value_name, number=number)
        for label, kind, field_name, number, oneof in fields:
            field = message.field.add(name=field_name, number=number, label=label)
            if kind.startswith("enum:"):
                field.type, field.type_name = F.TYPE_ENUM, kind[5:]
            elif kind.startswith("."):
                field.type, field.type_name = F.TYPE_MESSAGE, kind
            else:
                field.type = TYPES[kind]
            if oneof is not None:
                field.oneof_index = oneof
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("perfetto.protos.Trace"))


def parse_trace(data: bytes) -> Any:
    trace = trace_class()()
    trace.ParseFromString(data)
    return trace
