"""Error codes shared by every process, and the exception that carries them.

A `ProtocolError` is what every decoder raises for bad input; servers turn it
into an `ErrorReply` with the same code, so a client always learns *why*.
"""

from __future__ import annotations

from enum import Enum


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
    UNAVAILABLE = "unavailable"  # no expert could serve a step
    INTERNAL = "internal"  # a bug on our side; the message says more


class ProtocolError(ValueError):
    """Bad input. `code` is an `ErrorCode`; `str(err)` is a human sentence."""

    def __init__(self, code: ErrorCode | str, message: str):
        super().__init__(message)
        self.code = ErrorCode(code)
        self.message = message

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"ProtocolError({self.code.value!r}, {self.message!r})"
