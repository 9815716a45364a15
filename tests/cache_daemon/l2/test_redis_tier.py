"""L2 records (metadata + blob, checked by CRC-32 and a keyed MAC) and the degraded gate in front of a dead Redis."""
from __future__ import annotations

import zlib

import pytest

from cache_daemon.entry import ChunkKey, IncomingChunk
from cache_daemon.l2.address import parse_l2_address
from cache_daemon.l2.record_auth import parse_keyring
from cache_daemon.l2.redis_tier import (CORRUPTED, FORGED, GENUINE, UNKNOWN_KEY, L2Unavailable, RedisTier,
                                        decode_record, encode_record)
from tests.conftest import pick_free_port
from tests.daemon_support import NAMESPACE, digest


KEYRING = parse_keyring("k1 " + "11" * 32)


def incoming(blob: bytes, content_key: bytes = b"") -> IncomingChunk:
    return IncomingChunk(key=ChunkKey(digest("k")), namespace=NAMESPACE, content_key=content_key, num_tokens=7,
                         checksum=zlib.crc32(blob), pinned=True, blob=blob)


def test_a_record_round_trips_its_metadata_and_blob():
    chunk = incoming(b"kv bytes" * 100, content_key=digest("tokens"))
    hit, verdict = decode_record(chunk.key, encode_record(chunk, KEYRING), KEYRING)
    assert verdict == GENUINE
    assert hit.blob == chunk.blob
    assert (hit.entry.namespace, hit.entry.content_key, hit.entry.num_tokens, hit.entry.checksum) == \
        (NAMESPACE, digest("tokens"), 7, chunk.checksum)
    assert not hit.entry.pinned, "pins stay in L1: an L2 record never carries one"


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "bad header"])
def test_a_damaged_record_decodes_to_none(damage):
    chunk = incoming(b"kv bytes" * 100)
    record = bytearray(encode_record(chunk, KEYRING))
    if damage == "flip":
        record[-10] ^= 0x01
    elif damage == "truncate":
        del record[-1]
    elif damage == "empty":
        record = bytearray(b"\x01")
    else:
        record[1 + len(b"k1") + 32 + 2] = 99  # an unknown metadata version
    assert decode_record(chunk.key, bytes(record), KEYRING) == (None, CORRUPTED)


def test_a_forged_record_with_valid_crcs_is_forged():
    # The forger knows the layout and the key, writes a CRC-correct header and blob, but has no MAC key.
    chunk = incoming(b"attacker's K/V" * 50)
    forger = parse_keyring("k1 " + "22" * 32)  # same key id, another secret
    assert decode_record(chunk.key, encode_record(chunk, forger), KEYRING) == (None, FORGED)


def test_a_genuine_record_copied_under_another_key_is_forged():
    chunk = incoming(b"kv bytes" * 100)
    record = encode_record(chunk, KEYRING)
    assert decode_record(ChunkKey(digest("another prompt")), record, KEYRING) == (None, FORGED)


def test_an_altered_header_with_a_recomputed_crc_is_forged():
    chunk = incoming(b"kv bytes" * 100)
    record = bytearray(encode_record(chunk, KEYRING))
    record[-1] ^= 0x01  # the blob changed ...
    header_start = 1 + len(b"k1") + 32 + 2
    record[header_start + 9:header_start + 13] = zlib.crc32(bytes(record[-800:])).to_bytes(4, "little")
    assert decode_record(chunk.key, bytes(record), KEYRING) == (None, FORGED)  # ... and its CRC with it


def test_rotation_verifies_old_records_and_signs_with_the_first_key():
    chunk = incoming(b"kv bytes" * 100)
    old_record = encode_record(chunk, KEYRING)
    rotated = parse_keyring("k2 " + "33" * 32 + "\nk1 " + "11" * 32)
    assert decode_record(chunk.key, old_record, rotated)[1] == GENUINE
    new_record = encode_record(chunk, rotated)
    assert new_record[1:3] == b"k2"
    assert decode_record(chunk.key, new_record, KEYRING) == (None, UNKNOWN_KEY)  # k1-only daemons miss it


def test_a_dead_l2_fails_fast_until_the_retry_interval_passes():
    now = [100.0]
    tier = RedisTier(parse_l2_address(f"redis://127.0.0.1:{pick_free_port()}"), KEYRING, timeout_s=0.2,
                     retry_interval_s=5.0, clock=lambda: now[0])
    with pytest.raises(L2Unavailable, match="Connection refused|Error"):
        tier.get([ChunkKey(digest("a"))])
    assert (tier.degraded, tier.num_errors) == (True, 1)
    with pytest.raises(L2Unavailable, match="degraded; next try in 5.0 s"):
        tier.get([ChunkKey(digest("a"))])  # no connection attempt: the error count stays
    assert tier.num_errors == 1
    now[0] += 5.0
    with pytest.raises(L2Unavailable, match="Connection refused|Error"):
        tier.get([ChunkKey(digest("a"))])  # one try again after the interval
    assert tier.num_errors == 2
