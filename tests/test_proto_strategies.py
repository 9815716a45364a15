"""tests/proto_strategies.py: every field of every kvboost.v1 request can be generated, and unknown fields ride
through parsing as unknown fields (what a server of an older proto sees from a newer client)."""
from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message_factory import GetMessageClass
from google.protobuf.unknown_fields import UnknownFieldSet
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvboost.v1 import cache_pb2, inference_pb2
from kvboost.v1 import inference_pb2 as pb
from tests.proto_strategies import messages, scalar, unknown_field, wire_messages

REQUEST_TYPES = [method.input_type for module in (cache_pb2, inference_pb2)
                 for service in module.DESCRIPTOR.services_by_name.values() for method in service.methods]


def test_every_scalar_field_of_every_request_has_a_strategy():
    def fields(descriptor, seen):
        for field in descriptor.fields:
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                if field.message_type.full_name not in seen:
                    seen.add(field.message_type.full_name)
                    yield from fields(field.message_type, seen)
            else:
                yield field
    for descriptor in REQUEST_TYPES:
        for field in fields(descriptor, {descriptor.full_name}):
            assert scalar(field) is not None, field.full_name


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.sampled_from(REQUEST_TYPES).flatmap(lambda descriptor: st.tuples(st.just(descriptor),
                                                                             wire_messages(descriptor))))
def test_generated_wire_messages_parse_as_their_type(descriptor_and_bytes):
    descriptor, data = descriptor_and_bytes
    GetMessageClass(descriptor).FromString(data)  # never a DecodeError


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(messages(pb.GenerateRequest.DESCRIPTOR), unknown_field(pb.GenerateRequest.DESCRIPTOR))
def test_unknown_fields_are_kept_as_unknown(message, extra):
    parsed = pb.GenerateRequest.FromString(message.SerializeToString() + extra)
    assert len(UnknownFieldSet(parsed)) == 1
    assert parsed.SerializeToString().endswith(extra)
