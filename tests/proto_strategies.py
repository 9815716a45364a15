"""Hypothesis strategies for any protobuf message, built from its descriptor: every field type with its edge
values (empty, extreme integers, NaN and infinities, long and non-ASCII strings, long repeated fields, unknown
enum numbers), oneofs and proto3 `optional`, maps, nested messages, and wire bytes with unknown fields appended."""
from __future__ import annotations

import math

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass
from hypothesis import strategies as st

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
UINT32 = (0, 2**32 - 1)
UINT64 = (0, 2**64 - 1)
LONG_STRING = 20_000  # characters: long enough to cross every size check short of the message limit
LONG_REPEATED = 2_000


def _integers(low: int, high: int) -> st.SearchStrategy[int]:
    edges = sorted({low, low + 1, -1 if low < 0 else 0, 0, 1, 2, high - 1, high} & set(range(low, high + 1))
                   if high - low < 16 else {low, low + 1, 0, 1, 2, high - 1, high} | ({-1} if low < 0 else set()))
    return st.one_of(st.sampled_from(edges), st.integers(low, high), st.integers(0, 300))


_INTEGER_RANGES = {
    FieldDescriptor.TYPE_INT32: INT32, FieldDescriptor.TYPE_SINT32: INT32, FieldDescriptor.TYPE_SFIXED32: INT32,
    FieldDescriptor.TYPE_INT64: INT64, FieldDescriptor.TYPE_SINT64: INT64, FieldDescriptor.TYPE_SFIXED64: INT64,
    FieldDescriptor.TYPE_UINT32: UINT32, FieldDescriptor.TYPE_FIXED32: UINT32,
    FieldDescriptor.TYPE_UINT64: UINT64, FieldDescriptor.TYPE_FIXED64: UINT64,
}
_FLOAT_EDGES = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-45, 1e-7, 1e-6, 100.0, 3.4e38, -3.4e38, math.inf, -math.inf, math.nan]
_DOUBLE_EDGES = _FLOAT_EDGES + [5e-324, 1e308, -1e308]
_STRING_EDGES = ["", "a", " ", "\x00", "\u00e9\u4e2d\U0001f600", "<|im_end|>", "\u202e", "x" * LONG_STRING,
                 "\U0001f600" * (LONG_STRING // 4)]


def _strings() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(_STRING_EDGES), st.text(max_size=40), st.text(min_size=200, max_size=2000))


def _bytes() -> st.SearchStrategy[bytes]:
    return st.one_of(st.sampled_from([b"", b"\x00", b"\xff" * 32, bytes(range(256)), b"k" * LONG_STRING]),
                     st.binary(max_size=64))


def scalar(field: FieldDescriptor) -> st.SearchStrategy:
    """Values of one (non-repeated) scalar or enum field, edges first."""
    if field.type in _INTEGER_RANGES:
        return _integers(*_INTEGER_RANGES[field.type])
    if field.type == FieldDescriptor.TYPE_FLOAT:
        return st.one_of(st.sampled_from(_FLOAT_EDGES), st.floats(width=32, allow_nan=True))
    if field.type == FieldDescriptor.TYPE_DOUBLE:
        return st.one_of(st.sampled_from(_DOUBLE_EDGES), st.floats(allow_nan=True))
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type == FieldDescriptor.TYPE_STRING:
        return _strings()
    if field.type == FieldDescriptor.TYPE_BYTES:
        return _bytes()
    if field.type == FieldDescriptor.TYPE_ENUM:  # proto3 enums are open: unknown numbers pass through
        known = [value.number for value in field.enum_type.values]
        return st.one_of(st.sampled_from(known), st.sampled_from([max(known) + 1, -1, INT32[0], INT32[1]]))
    raise AssertionError(f"no strategy for field {field.full_name} of type {field.type}")


def _is_map(field: FieldDescriptor) -> bool:
    return field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry


def _repeated(element: st.SearchStrategy, field: FieldDescriptor) -> st.SearchStrategy[list]:
    long = (st.lists(element, min_size=LONG_REPEATED, max_size=LONG_REPEATED)
            if field.type not in (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)
            else st.lists(element, min_size=50, max_size=200))
    return st.one_of(st.just([]), st.lists(element, min_size=1, max_size=4), long)


def messages(descriptor: Descriptor, max_depth: int = 3) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`'s type: each field set or not (one field per oneof), nested to max_depth."""
    message_class = GetMessageClass(descriptor)

    @st.composite
    def build(draw) -> Message:
        message = message_class()
        chosen_in_oneof = {oneof.name: draw(st.sampled_from([None, *oneof.fields]))
                           for oneof in descriptor.oneofs}
        for field in descriptor.fields:
            oneof = field.containing_oneof
            if oneof is not None and chosen_in_oneof[oneof.name] is not field:
                continue
            if oneof is None and not draw(st.booleans()):
                continue
            _set_field(draw, message, field, max_depth)
        return message

    return build()


def _set_field(draw, message: Message, field: FieldDescriptor, max_depth: int) -> None:
    if _is_map(field):
        key_field, value_field = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
        if value_field.type == FieldDescriptor.TYPE_MESSAGE:
            if max_depth > 0:
                for key in draw(st.lists(scalar(key_field), max_size=3)):
                    getattr(message, field.name)[key].CopyFrom(draw(messages(value_field.message_type, max_depth - 1)))
            return
        getattr(message, field.name).update(draw(st.dictionaries(scalar(key_field), scalar(value_field), max_size=4)))
        return
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        if max_depth <= 0:
            return
        element = messages(field.message_type, max_depth - 1)
        if field.is_repeated:
            getattr(message, field.name).extend(draw(st.one_of(st.just([]), st.lists(element, min_size=1, max_size=4))))
        else:
            getattr(message, field.name).CopyFrom(draw(element))
        return
    if field.is_repeated:
        getattr(message, field.name).extend(draw(_repeated(scalar(field), field)))
    else:
        setattr(message, field.name, draw(scalar(field)))


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def unknown_field(descriptor: Descriptor) -> st.SearchStrategy[bytes]:
    """The wire bytes of one field whose number the message does not define, of any wire type."""
    known = {field.number for field in descriptor.fields}
    numbers = st.one_of(st.integers(1, 64), st.sampled_from([1000, 19999, 20000 - 1, 2**29 - 1])).filter(
        lambda number: number not in known)

    @st.composite
    def build(draw) -> bytes:
        number = draw(numbers)
        wire_type = draw(st.sampled_from([0, 1, 2, 5]))  # varint, fixed64, length-delimited, fixed32
        tag = _varint(number << 3 | wire_type)
        if wire_type == 0:
            return tag + _varint(draw(st.integers(0, 2**64 - 1)))
        if wire_type == 1:
            return tag + draw(st.binary(min_size=8, max_size=8))
        if wire_type == 5:
            return tag + draw(st.binary(min_size=4, max_size=4))
        payload = draw(st.binary(max_size=64))
        return tag + _varint(len(payload)) + payload
    return build()


def wire_messages(descriptor: Descriptor, max_depth: int = 3) -> st.SearchStrategy[bytes]:
    """Serialized messages, a third of them with unknown fields appended (a newer client's fields)."""
    plain = messages(descriptor, max_depth).map(lambda message: message.SerializeToString())
    with_unknown = st.tuples(plain, st.lists(unknown_field(descriptor), min_size=1, max_size=3)).map(
        lambda parts: parts[0] + b"".join(parts[1]))
    return st.one_of(plain, plain, with_unknown)
