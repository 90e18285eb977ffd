"""Wire schemas for ddm-fleet: messages, tensor codec, subjects, limits, version.

Everything that crosses a process boundary is defined here and nowhere else.
See docs/PROTOCOL.md for the language-neutral description.
"""

from . import subjects
from .errors import ErrorCode, ProtocolError
from .limits import MAX_DONE_PARTS, MAX_JOB_IMAGES, MAX_JOB_STEPS, MAX_PAYLOAD_BYTES, MAX_STEP_ROWS
from .messages import (
    TIME_CONVENTION,
    UNCONDITIONAL,
    CancelReply,
    CancelRequest,
    DecodeReply,
    DecodeRequest,
    DecodeResult,
    DoneEvent,
    DonePartEvent,
    ErrorReply,
    FailedEvent,
    FleetStatus,
    FrameEvent,
    JobAccepted,
    JobEvent,
    JobRejected,
    JobRequest,
    JobStatus,
    StepReply,
    StepRequest,
    StepResult,
    SubmitReply,
)
from .tensor import decode_tensor, encode_tensor
from .version import PROTOCOL_VERSION
from .wire import loads, pack, unpack, validate

__all__ = [
    "subjects",
    "ErrorCode",
    "ProtocolError",
    "MAX_DONE_PARTS",
    "MAX_JOB_IMAGES",
    "MAX_JOB_STEPS",
    "MAX_PAYLOAD_BYTES",
    "MAX_STEP_ROWS",
    "TIME_CONVENTION",
    "UNCONDITIONAL",
    "CancelReply",
    "CancelRequest",
    "DecodeReply",
    "DecodeRequest",
    "DecodeResult",
    "DoneEvent",
    "DonePartEvent",
    "ErrorReply",
    "FailedEvent",
    "FleetStatus",
    "FrameEvent",
    "JobAccepted",
    "JobEvent",
    "JobRejected",
    "JobRequest",
    "JobStatus",
    "StepReply",
    "StepRequest",
    "StepResult",
    "SubmitReply",
    "decode_tensor",
    "encode_tensor",
    "PROTOCOL_VERSION",
    "loads",
    "pack",
    "unpack",
    "validate",
]
