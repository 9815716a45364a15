"""Chunks to vLLM blocks: only the contiguous run from position 0, each block once, parents first."""
from kvboost_common.kv_events.block_grid import BlockGrid, ChunkTokens, block_hash

SEED = b"s"


def make_grid(block_size: int = 4) -> BlockGrid:
    return BlockGrid(block_size, SEED, "GPU")


def note_chunks(grid: BlockGrid, *chunks: tuple[bytes, int, tuple[int, ...]]) -> None:
    """Notes (key, start, tokens) in order, each chaining from the one before."""
    parent = None
    for key, start, tokens in chunks:
        grid.note(key, ChunkTokens(start, tokens, parent))
        parent = key


def stored(hashes, parent, tokens):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None}


# Block hashes of tokens 0..11 in blocks of 4: each chains over the one before, from the seed.
H0 = block_hash(None, (0, 1, 2, 3), SEED)
H1 = block_hash(H0, (4, 5, 6, 7), SEED)
H2 = block_hash(H1, (8, 9, 10, 11), SEED)


def test_block_hash_is_sha256_over_parent_and_little_endian_tokens():
    assert H0 == 8546006587502921818
    assert H1 == 5206360901995832895


def test_chunks_of_six_publish_blocks_of_four_once_connected():
    grid = make_grid()
    note_chunks(grid, (b"k0", 0, (0, 1, 2, 3, 4, 5)), (b"k1", 6, (6, 7, 8, 9, 10, 11)))
    # k1 arrives first: its parent is not held, so nothing of it lies in a run from position 0
    assert grid.add(b"k1") == []
    # k0 connects itself (block 0; tokens 4, 5 wait for the next chunk), then k1 (block 1 straddles both, block 2)
    assert grid.add(b"k0") == [stored([H0], None, [0, 1, 2, 3]), stored([H1, H2], H0, list(range(4, 12)))]
    assert grid.num_blocks == 3
    # k0 leaves: k1 stays held but no longer starts at 0; children's blocks go first
    assert grid.remove(b"k0") == [{"type": "BlockRemoved", "block_hashes": [H2, H1, H0], "medium": "GPU"}]
    assert grid.num_blocks == 0
    # k0 back: the whole run again
    assert grid.add(b"k0") == [stored([H0], None, [0, 1, 2, 3]), stored([H1, H2], H0, list(range(4, 12)))]


def test_a_block_two_chunks_own_leaves_with_the_last():
    grid = make_grid()
    note_chunks(grid, (b"k0", 0, (0, 1, 2, 3, 4, 5)), (b"k1", 6, (6, 7, 8, 9, 10, 11)))
    note_chunks(grid, (b"k0", 0, (0, 1, 2, 3, 4, 5)), (b"tail", 6, (6, 7)))  # a prompt that ended at token 7
    grid.add(b"k0")
    grid.add(b"k1")
    # the tail's only whole block is block 1, already announced by k1: no event
    assert grid.add(b"tail") == []
    assert grid.remove(b"k1") == [{"type": "BlockRemoved", "block_hashes": [H2], "medium": "GPU"}]
    assert grid.remove(b"tail") == [{"type": "BlockRemoved", "block_hashes": [H1], "medium": "GPU"}]


def test_a_run_of_new_blocks_restarts_after_a_known_one():
    grid = make_grid()
    note_chunks(grid, (b"short", 0, (0, 1, 2, 3, 4, 5, 6, 7)))
    note_chunks(grid, (b"a", 0, (0, 1, 2, 3)), (b"b", 4, (4, 5, 6, 7, 8, 9, 10, 11)))
    grid.add(b"short")  # blocks 0 and 1
    grid.add(b"a")  # block 0 again: no event
    assert grid.add(b"b") == [stored([H2], H1, [8, 9, 10, 11])]


def test_unknown_chunks_are_never_announced_nor_their_children():
    grid = make_grid()
    note_chunks(grid, (b"k0", 0, (0, 1, 2, 3)))
    grid.note(b"child", ChunkTokens(4, (4, 5, 6, 7), b"salted-parent"))
    assert grid.add(b"salted-parent") == []  # never noted (a salted prompt's chunk)
    assert grid.add(b"child") == []
    assert grid.remove(b"salted-parent") == []
    assert grid.num_blocks == 0


def test_notes_are_bounded_least_recent_first():
    grid = BlockGrid(4, SEED, "CPU", max_noted=2)
    for index in range(3):
        grid.note(bytes([index]), ChunkTokens(0, (index,) * 4, None))
    assert grid.add(b"\x00") == []  # dropped from the notes
    assert grid.add(b"\x02")[0]["medium"] == "CPU"
