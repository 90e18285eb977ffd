"""Error codes shared by every process, and the exception that carries them.

A `ProtocolError` is what every decoder raises for bad input; servers turn it
into an `ErrorReply` with the same code, so a client always learns *why*.
"""

from __future__ import annotations

import re
import reprlib
from enum import Enum
from typing import Any

#: NATS header of a `rate_limited` answer (an `error` reply, a `rejected` submit, a refused cancel): the
#: seconds, a decimal number ("0.50"), after which the same request would be let through. In a header, so
#: the msgpack body stays what clients that predate it read.
RETRY_AFTER_HEADER = "Ddm-Retry-After"

#: What a code looks like on the wire (known or not): lowercase snake_case, at most 64 characters.
_CODE_PATTERN = re.compile(r"[a-z][a-z0-9_]{0,63}")


class ErrorCode(str, Enum):
    """Machine-readable reason for a failure; stable across versions."""

    BAD_REQUEST = "bad_request"  # undecodable bytes, wrong types, missing fields
    BAD_SHAPE = "bad_shape"  # tensor shapes disagree with each other or the model
    BAD_DTYPE = "bad_dtype"  # dtype refused (object, unknown, wrong kind)
    NON_FINITE = "non_finite"  # NaN or Inf where the schema forbids it
    TOO_LARGE = "too_large"  # payload or batch over the configured limit
    UNSUPPORTED_VERSION = "unsupported_version"  # protocol version we do not speak
    UNKNOWN_EXPERT = "unknown_expert"  # expert id not served here / not in the ensemble
    DEADLINE_EXCEEDED = "deadline_exceeded"  # request or job deadline passed
    OVERLOADED = "overloaded"  # admission control: too many rows / jobs
    CANCELLED = "cancelled"  # job cancelled by its client
    UNAVAILABLE = "unavailable"  # no expert could serve a step; the coordinator is gone or lost the job
    BAD_REPLY = "bad_reply"  # an expert worker answered with an invalid reply (NaN, wrong shape, ...) on every try
    DECODER_UNAVAILABLE = "decoder_unavailable"  # a latent job's decoder did not answer usably (none running, timeouts)
    INTERNAL = "internal"  # a bug on our side; the message says more
    RATE_LIMITED = "rate_limited"  # this client sent more requests of a kind per second than allowed; retry later

    @classmethod
    def _missing_(cls, value: object) -> ErrorCode | None:
        """A code this release does not know, from a newer peer (codes may be added within v1): kept
        as its own string, a failure like any other. Only short snake_case strings qualify."""
        if isinstance(value, str) and _CODE_PATTERN.fullmatch(value):
            member = str.__new__(cls, value)
            member._name_ = value.upper()
            member._value_ = value
            return member
        return None


class ProtocolError(ValueError):
    """Bad input. `code` is an `ErrorCode`; `str(err)` is a human sentence."""

    def __init__(self, code: ErrorCode | str, message: str):
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"ProtocolError({self.code.value!r}, {self.message!r})"


_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = 12
_REPR.maxdict = 8
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 60


def shown(value: Any) -> str:
    """`repr()` for error messages about untrusted input: bounded in length and depth.

    A plain repr of a 1000-level nested list (msgpack decodes 1024 levels) raises RecursionError,
    and a plain repr of an 8 MiB string is an 8 MiB error message."""
    try:
        return _REPR.repr(value)
    except Exception:  # e.g. an int too long for str()
        return f"<{type(value).__name__}>"
