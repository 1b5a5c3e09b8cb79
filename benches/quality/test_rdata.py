"""Unit tests of the pure-Python R lazy-load decoder (no network, no torch)."""

import struct
import sys
import zlib
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import rdata  # noqa: E402


def test_hand_made_string_vector():
    strings = ["It is a truth universally acknowledged,", "", None, "naïve"]
    assert rdata.unserialize(rdata.make_xdr_strvec(strings)) == strings


def test_rdb_record_roundtrip():
    buf = rdata.make_xdr_strvec(["a", "bc"])
    rec = b"junk" + struct.pack(">I", len(buf)) + zlib.compress(buf)
    assert rdata.read_rdb_record(rec, 4, len(rec) - 4, True) == ["a", "bc"]


def test_bad_length_is_an_error():
    buf = rdata.make_xdr_strvec(["a"])
    rec = struct.pack(">I", len(buf) + 1) + zlib.compress(buf)
    with pytest.raises(rdata.RDecodeError):
        rdata.read_rdb_record(rec, 0, len(rec), True)


def test_selftest():
    rdata.selftest()
