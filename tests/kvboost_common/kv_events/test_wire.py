"""vLLM's KV-event format: exact maps and bytes."""
import msgpack
import pytest

from kvboost_common.kv_events.wire import (all_blocks_cleared, block_removed, block_stored, decode_batch,
                                           decode_sequence, encode_batch, encode_sequence, message_frames)


def test_block_stored_has_exactly_vllms_keys():
    event = block_stored([11, 12], 10, list(range(8)), 4, "GPU")
    assert event == {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": 10,
                     "token_ids": [0, 1, 2, 3, 4, 5, 6, 7], "block_size": 4, "lora_id": None, "medium": "GPU",
                     "lora_name": None}


def test_block_stored_refuses_tokens_that_do_not_fill_the_blocks():
    with pytest.raises(AssertionError, match="need 8 token ids"):
        block_stored([11, 12], None, list(range(7)), 4, "GPU")


def test_removed_and_cleared():
    assert block_removed([5], "CPU") == {"type": "BlockRemoved", "block_hashes": [5], "medium": "CPU"}
    assert all_blocks_cleared() == {"type": "AllBlocksCleared"}
    with pytest.raises(AssertionError, match="medium"):
        block_removed([5], "HBM")


def test_batch_is_a_positional_msgpack_array():
    payload = encode_batch(1.5, [all_blocks_cleared()])
    # fixarray(3), float64 1.5, fixarray(1) of fixmap(1) {"type": "AllBlocksCleared"}, nil
    assert payload == (b"\x93\xcb" + bytes.fromhex("3ff8000000000000")
                       + b"\x91\x81\xa4type\xb0AllBlocksCleared\xc0")
    assert decode_batch(payload) == (1.5, [{"type": "AllBlocksCleared"}], None)
    assert msgpack.unpackb(encode_batch(2.0, [], 0)) == [2.0, [], 0]


def test_frames_topic_sequence_payload():
    assert encode_sequence(0) == b"\x00" * 8
    assert encode_sequence(258) == b"\x00\x00\x00\x00\x00\x00\x01\x02"
    assert encode_sequence(-1) == b"\xff" * 8
    assert decode_sequence(b"\xff" * 8) == -1
    assert message_frames("kv@pod@model", 1, b"p") == [b"kv@pod@model", b"\x00" * 7 + b"\x01", b"p"]
    assert message_frames("", 0, b"p")[0] == b""
