"""vLLM's KV-event wire format, pure: the event maps, the msgpack batch and the frames of one message."""
from __future__ import annotations

from collections.abc import Sequence

import msgpack

# Which tier a block lives in, as the routers weigh it (vllm-router: GPU or nil full credit, CPU 0.8, DISK 0.3).
MEDIUMS = ("GPU", "CPU", "DISK")
# The sequence frame of the message that ends a replay: -1, with an empty payload.
REPLAY_END_SEQUENCE = -1


def block_stored(block_hashes: Sequence[int], parent_block_hash: int | None, token_ids: Sequence[int],
                 block_size: int, medium: str) -> dict:
    """A BlockStored event: consecutive blocks, each chaining from the one before it (the first from
    parent_block_hash; None: from the start of the prompt), and their token ids, block_size per block.

    Exactly the keys vLLM sends (a consumer drops a batch with a key it does not know); LoRA is never used here.
    """
    assert medium in MEDIUMS, f"medium must be one of {MEDIUMS}, got {medium!r}"
    assert block_hashes, "a BlockStored event names at least one block"
    assert len(token_ids) == len(block_hashes) * block_size, (
        f"{len(block_hashes)} blocks of {block_size} tokens need {len(block_hashes) * block_size} token ids, "
        f"got {len(token_ids)}")
    return {"type": "BlockStored", "block_hashes": list(block_hashes), "parent_block_hash": parent_block_hash,
            "token_ids": list(token_ids), "block_size": block_size, "lora_id": None, "medium": medium,
            "lora_name": None}


def block_removed(block_hashes: Sequence[int], medium: str) -> dict:
    """A BlockRemoved event: these blocks left the medium."""
    assert medium in MEDIUMS, f"medium must be one of {MEDIUMS}, got {medium!r}"
    return {"type": "BlockRemoved", "block_hashes": list(block_hashes), "medium": medium}


def all_blocks_cleared() -> dict:
    """An AllBlocksCleared event: every block this publisher announced is gone."""
    return {"type": "AllBlocksCleared"}


def encode_batch(timestamp: float, events: Sequence[dict], data_parallel_rank: int | None = None) -> bytes:
    """The payload frame: the positional array [ts, events, data_parallel_rank] in msgpack."""
    return msgpack.packb([timestamp, list(events), data_parallel_rank], use_bin_type=True)


def decode_batch(payload: bytes) -> tuple[float, list[dict], int | None]:
    """The inverse of encode_batch (tests and the benchmark's subscriber read the stream with it)."""
    timestamp, events, rank = msgpack.unpackb(payload, raw=False)
    return timestamp, events, rank


def encode_sequence(sequence: int) -> bytes:
    """The sequence frame: 8 bytes, big-endian, signed (-1 ends a replay)."""
    return sequence.to_bytes(8, "big", signed=True)


def decode_sequence(frame: bytes) -> int:
    assert len(frame) == 8, f"a sequence frame is 8 bytes, got {len(frame)}"
    return int.from_bytes(frame, "big", signed=True)


def message_frames(topic: str, sequence: int, payload: bytes) -> list[bytes]:
    """The three frames of one published batch: topic, sequence, payload."""
    return [topic.encode(), encode_sequence(sequence), payload]
