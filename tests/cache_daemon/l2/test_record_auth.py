"""The L2 key file: what it accepts, what it refuses and with which advice; MACs bound to key and content."""
from __future__ import annotations

import pytest

from cache_daemon.l2.record_auth import load_keyring, parse_keyring

KEY_1 = "k1 " + "ab" * 32
KEY_2 = "k2 " + "cd" * 32


def test_the_first_key_signs_and_every_key_verifies():
    keyring = parse_keyring(f"# rotated on Monday\n{KEY_2}\n\n{KEY_1}\n")
    assert (keyring.signing_id, sorted(keyring.keys)) == ("k2", ["k1", "k2"])
    key_id, mac = keyring.sign(b"record key", b"header and blob")
    assert key_id == b"k2" and keyring.verify(key_id, mac, b"record key", b"header and blob")
    assert not keyring.verify(key_id, mac, b"other key", b"header and blob")
    assert not keyring.verify(key_id, mac, b"record key", b"header and blob!")
    assert not keyring.verify(b"k1", mac, b"record key", b"header and blob"), "the key id is signed too"
    assert not keyring.verify(b"k9", mac, b"record key", b"header and blob")


def test_the_key_never_shows_in_repr_and_parts_sign_as_if_joined():
    keyring = parse_keyring(KEY_1)
    assert "ab" * 32 not in repr(keyring)
    assert keyring.sign(b"key", b"header", b"blob") == keyring.sign(b"key", b"headerblob")


@pytest.mark.parametrize("text, message", [
    ("", "holds no key; make one"),
    ("k1 abcd", "fewer than 32; make one"),
    ("k1 " + "zz" * 32, "is not hex"),
    ("k1", "expected 'KEY_ID HEX'"),
    ("k/1 " + "ab" * 32, "expected 'KEY_ID HEX'"),
    (f"{KEY_1}\n{KEY_1}", "appears twice"),
])
def test_bad_key_files_are_refused_with_what_to_fix(text, message):
    with pytest.raises(ValueError, match=message):
        parse_keyring(text)


def test_a_missing_key_file_says_how_to_make_one(tmp_path):
    with pytest.raises(ValueError, match=r"cannot read --l2-key-file .*secrets.token_hex\(32\)"):
        load_keyring(tmp_path / "absent.key")


def test_a_key_file_others_may_read_is_used_with_a_warning(tmp_path, caplog):
    path = tmp_path / "l2.key"
    path.write_text(KEY_1)
    path.chmod(0o600)
    load_keyring(path)
    assert not [record for record in caplog.records if "chmod 600" in record.getMessage()]
    path.chmod(0o644)
    assert load_keyring(path).signing_id == "k1"
    assert [record for record in caplog.records if "readable by others than its owner (mode 644)" in record.getMessage()]
