"""Every decode failure says why: msgpack's C decoder raises some errors with no text at all
(FormatError for 0xc1, StackError for deep nesting); the ProtocolError must still carry a reason."""

from __future__ import annotations

import msgpack
import pytest

from schemas import ErrorCode, JobRequest, ProtocolError, unpack
from schemas.wire import decode_failure

CORRUPT = {
    "0xc1 (never used)": b"\xc1",
    "0xc1 inside a map": b"\x81\xa1v\xc1",
    "nested past the decoder's limit": b"\x91" * 2000 + b"\x90",
    "truncated": b"\x82\xa1v\x01",
    "trailing bytes": b"\x01\x02",
}


@pytest.mark.parametrize("raw", CORRUPT.values(), ids=CORRUPT.keys())
def test_undecodable_bytes_always_come_with_a_reason(raw):
    with pytest.raises(ProtocolError) as err:
        unpack(raw, JobRequest)
    assert err.value.code is ErrorCode.BAD_REQUEST
    assert err.value.message.startswith("undecodable msgpack: ")
    name, _, reason = err.value.message.removeprefix("undecodable msgpack: ").partition(": ")
    assert name and len(reason.strip()) >= 10, err.value.message


def test_silent_decoder_errors_are_explained():
    """The decoder really is silent for these (else this test proves nothing), and we fill in why."""
    for raw, name, words in ((b"\xc1", "FormatError", "0xc1"), (b"\x91" * 2000 + b"\x90", "StackError", "1024")):
        with pytest.raises(Exception) as raw_err:
            msgpack.unpackb(raw, raw=False)
        assert type(raw_err.value).__name__ == name and str(raw_err.value) == ""
        text = decode_failure(raw_err.value)
        assert text.startswith(f"{name}: ") and words in text, text


def test_an_unknown_silent_error_still_gets_a_reason():
    class OddError(Exception):
        pass

    text = decode_failure(OddError())
    assert text.startswith("OddError: ") and "no reason" in text
    assert (
        decode_failure(ValueError("Unpack failed: incomplete input")) == "ValueError: Unpack failed: incomplete input"
    )
