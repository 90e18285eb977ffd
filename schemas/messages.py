"""Every message that crosses a process boundary, as pydantic v2 models.

Each message carries `v` (protocol version) and `kind` (which message it is).
Tensors are numpy arrays in Python and `{dtype, shape, data}` maps on the wire
(see `schemas.tensor`). Encode with `schemas.wire.pack`, decode with `unpack`.

Time convention (flow matching, used everywhere): **t = 0 is pure noise, t = 1 is
data**; x_t = (1 - t) * noise + t * data and the velocity is v = data - noise.
A sampler integrates dx/dt = v from t = 0 to t = 1.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    WithJsonSchema,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from .errors import ErrorCode, ProtocolError, shown
from .limits import (
    MAX_DONE_PARTS,
    MAX_GUIDANCE_SCALE,
    MAX_ID_LEN,
    MAX_JOB_IMAGES,
    MAX_JOB_STEPS,
    MAX_RUN_AHEAD,
    MAX_STEP_ROWS,
)
from .spec import MAX_CLASSES, TIME_CONVENTION, ModelSpec  # noqa: F401 (TIME_CONVENTION: re-exported by schemas)
from .tensor import FLOAT_DTYPES, INT_DTYPES, decode_tensor, encode_tensor
from .version import PROTOCOL_VERSION


def _tensor_validator(finite: bool):
    def validate(value: Any, info) -> np.ndarray:
        try:
            return decode_tensor(value, name=info.field_name or "tensor", finite=finite)
        except ProtocolError as err:
            raise PydanticCustomError(err.code.value, err.message) from None

    return validate


def _tensor_type(finite: bool):
    from pydantic.functional_validators import PlainValidator

    return Annotated[
        np.ndarray,
        PlainValidator(_tensor_validator(finite)),
        PlainSerializer(lambda a: encode_tensor(a), return_type=dict),
        WithJsonSchema(
            {
                "type": "object",
                "properties": {
                    "dtype": {"type": "string"},
                    "shape": {"type": "array"},
                    "data": {"type": "string", "format": "binary"},
                },
            }
        ),
    ]


#: Any allowed tensor.
Tensor = _tensor_type(finite=False)
#: A tensor whose float values must all be finite (no NaN / Inf).
FiniteTensor = _tensor_type(finite=True)

Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_LEN)]


def _to_error_code(value: Any) -> Any:
    """Wire strings -> ErrorCode (wire validation is strict, which wants the enum itself)."""
    if isinstance(value, ErrorCode):
        return value
    try:
        return ErrorCode(value) if isinstance(value, str) else ErrorCode(None)
    except ValueError:
        raise PydanticCustomError(
            ErrorCode.BAD_REQUEST.value,
            f"error code must be one of {sorted(c.value for c in ErrorCode)} (or another lowercase "
            f"snake_case code of a newer release), got {shown(value)}",
        ) from None


#: An ErrorCode field; accepts the enum or its string value.
Code = Annotated[ErrorCode, BeforeValidator(_to_error_code)]

#: Longest human-readable reason/message carried; longer ones are cut (with "…").
MAX_MESSAGE_LEN = 4096


def _clip(value: Any) -> Any:
    if isinstance(value, str) and len(value) > MAX_MESSAGE_LEN:
        return value[: MAX_MESSAGE_LEN - 1] + "…"
    return value


#: A human sentence; never rejected for length, clipped to MAX_MESSAGE_LEN instead.
Text = Annotated[str, BeforeValidator(_clip)]

#: Longest coordinator name / instance id (`accepted`, `job_status`).
MAX_COORDINATOR_NAME_LEN = 128

#: A coordinator's name or instance id: at most MAX_COORDINATOR_NAME_LEN characters ("" = not said).
CoordinatorName = Annotated[str, Field(max_length=MAX_COORDINATOR_NAME_LEN)]
Strategy = Literal["top1", "topk", "full", "oracle", "sample"]
#: A float precision an expert step may travel in (`schemas.tensor.WIRE_FLOATS`).
WireFloat = Literal["float32", "float16", "bfloat16"]

#: StepRequest's optional fields for running ahead (left out of the wire map when unused).
_AHEAD_FIELDS = ("ahead_t", "ahead_dt", "input_dtype")
Solver = Literal["euler", "heun"]
#: The label of an unconditional row ("label unknown"): a `JobRequest.labels` (or `digits`) entry and a
#: `StepRequest.y` value. Experts trained with a null label (`train-expert --label-dropout`) and
#: the router map it to their learned null embedding; other experts refuse it (`bad_request`).
UNCONDITIONAL = -1


def _err(code: ErrorCode, msg: str) -> PydanticCustomError:
    return PydanticCustomError(code.value, msg)


def _need_float(a: np.ndarray, name: str) -> None:
    if a.dtype.str not in FLOAT_DTYPES:
        raise _err(ErrorCode.BAD_DTYPE, f"{name} must be a float tensor (<f2, <f4 or <f8), got {a.dtype.str}")


def _need_int(a: np.ndarray, name: str) -> None:
    if a.dtype.str not in INT_DTYPES:
        raise _err(ErrorCode.BAD_DTYPE, f"{name} must be an integer tensor, got {a.dtype.str}")


#: A job's owner epoch (`JobRequest.report_epoch`): a number that strictly increases each time the job
#: changes owner (a durable job taken over by another coordinator, or by a restart): 0 for a job that
#: is not durable, 1 for a durable job's first owner, one more at each take-over. A client keeps the
#: highest it has seen and drops events of a lower one (client.epochs).
Epoch = Annotated[int, Field(ge=0, lt=2**63)]


class Message(BaseModel):
    """Base: protocol version check, strict field set, arrays allowed."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, frozen=False, strict=False)

    v: int = PROTOCOL_VERSION

    @field_validator("v", mode="before")
    @classmethod
    def _check_version(cls, value: Any) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _err(ErrorCode.BAD_REQUEST, f"protocol version v must be an int, got {shown(value)}")
        if value != PROTOCOL_VERSION:
            raise _err(
                ErrorCode.UNSUPPORTED_VERSION,
                f"protocol version {value} is not supported; this build speaks v{PROTOCOL_VERSION}",
            )
        return value


# ---------------------------------------------------------------- expert step


class StepRequest(Message):
    """Coordinator -> expert worker: one batched velocity evaluation.

    x_t: [B, C, H, W] float, finite.  t: [B] float in [0, 1].  y: [B] int class labels.
    guidance: [B] float, finite, each in [0, MAX_GUIDANCE_SCALE], or None (left out of the wire map):
    classifier-free guidance, row r's velocity is v(x, null) + s_r (v(x, y_r) - v(x, null))
    (`flow.guidance`); rows with s_r = 1 or y_r = -1 are answered as without it. Only a model with a
    null label serves a guided row (else `bad_request`); older workers refuse the key (`bad_request`),
    so a coordinator sends it only to workers that advertise `guidance`.
    row_ids: B opaque ids echoed back.  deadline: unix time (s) after which the
    worker drops the request instead of computing it.  reply_dtype: the precision the velocity
    should travel back in ("float32" | "float16" | "bfloat16"; None = float32, and then the field
    is left out of the wire map so that workers older than the field accept the request).
    request_id: the same for every copy of one try (a hedged request is sent twice with it).

    Running ahead (ahead_t and ahead_dt together, or neither; left out of the wire map when unused,
    so that older workers accept the request). The worker answers the step at t as usual, then takes
    A more Euler steps on its own, x' = x + ahead_dt[a] * v (`flow.solver.euler_update`, with v as
    the reply carries it: in `reply_dtype`, widened to float32), evaluates at t' = ahead_t[a], and
    answers each of those A velocities on the same reply subject as a StepReply with `ahead_index`
    a + 1, in order (an ErrorReply there ends the run). The model sees each x as it would have
    travelled: rounded to `input_dtype` (None: float32). x_t must be float32 then (the steps start
    from it). ahead_t: [A, B] float in [0, 1].  ahead_dt: [A, B] float.
    A coordinator uses the answers only where its own routing and state agree with them.
    """

    kind: Literal["step_request"] = "step_request"
    expert: int = Field(ge=0)
    x_t: FiniteTensor
    t: FiniteTensor
    y: Tensor
    row_ids: list[Id] = Field(default_factory=list)
    deadline: float | None = None
    request_id: Id | None = None
    reply_dtype: WireFloat | None = None
    ahead_t: FiniteTensor | None = None
    ahead_dt: FiniteTensor | None = None
    input_dtype: WireFloat | None = None
    guidance: FiniteTensor | None = None

    @model_serializer(mode="wrap")
    def _omit_default_reply_dtype(self, handler):  # not on the wire unless asked: older workers refuse unknown keys
        out = handler(self)
        if isinstance(out, dict):
            for key in ("reply_dtype", *_AHEAD_FIELDS, "guidance"):
                if getattr(self, key) is None:
                    out.pop(key, None)
        return out

    @property
    def ahead(self) -> int:
        """Further steps asked for (0: an ordinary request)."""
        return 0 if self.ahead_t is None else int(self.ahead_t.shape[0])

    @model_validator(mode="after")
    def _check(self) -> StepRequest:
        _need_float(self.x_t, "x_t")
        _need_float(self.t, "t")
        _need_int(self.y, "y")
        if self.x_t.ndim != 4:
            raise _err(ErrorCode.BAD_SHAPE, f"x_t must be [B, C, H, W], got shape {list(self.x_t.shape)}")
        b = self.x_t.shape[0]
        if b == 0:
            raise _err(ErrorCode.BAD_SHAPE, "x_t has an empty batch (B = 0)")
        if b > MAX_STEP_ROWS:
            raise _err(ErrorCode.TOO_LARGE, f"batch of {b} rows exceeds the limit of {MAX_STEP_ROWS}")
        if self.t.shape != (b,):
            raise _err(ErrorCode.BAD_SHAPE, f"t must be [B] = [{b}], got {list(self.t.shape)}")
        if self.y.shape != (b,):
            raise _err(ErrorCode.BAD_SHAPE, f"y must be [B] = [{b}], got {list(self.y.shape)}")
        if self.row_ids and len(self.row_ids) != b:
            raise _err(ErrorCode.BAD_SHAPE, f"row_ids has {len(self.row_ids)} entries for a batch of {b}")
        if ((self.t < 0) | (self.t > 1)).any():
            raise _err(ErrorCode.BAD_REQUEST, "t must lie in [0, 1] (t=0 noise, t=1 data)")
        if self.guidance is not None:
            self._check_guidance(b)
        if self.ahead_t is not None or self.ahead_dt is not None:
            self._check_ahead(b)
        elif self.input_dtype is not None:
            raise _err(ErrorCode.BAD_REQUEST, "input_dtype is only for a request that runs ahead (ahead_t)")
        return self

    def _check_guidance(self, b: int) -> None:
        _need_float(self.guidance, "guidance")
        if self.guidance.shape != (b,):
            raise _err(ErrorCode.BAD_SHAPE, f"guidance must be [B] = [{b}], got {list(self.guidance.shape)}")
        if ((self.guidance < 0) | (self.guidance > MAX_GUIDANCE_SCALE)).any():
            raise _err(
                ErrorCode.BAD_REQUEST,
                f"guidance scales must lie in [0, {MAX_GUIDANCE_SCALE:g}] (1 = no guidance), got "
                f"min {float(self.guidance.min()):g} max {float(self.guidance.max()):g}",
            )

    def _check_ahead(self, b: int) -> None:
        if self.ahead_t is None or self.ahead_dt is None:
            raise _err(ErrorCode.BAD_REQUEST, "running ahead needs ahead_t and ahead_dt together")
        _need_float(self.ahead_t, "ahead_t")
        _need_float(self.ahead_dt, "ahead_dt")
        a = self.ahead_t.shape[0] if self.ahead_t.ndim == 2 else 0
        if self.ahead_t.shape != (a, b) or not 1 <= a <= MAX_RUN_AHEAD:
            raise _err(
                ErrorCode.BAD_SHAPE,
                f"ahead_t must be [A, B] with B = {b} and 1 <= A <= {MAX_RUN_AHEAD}, got {list(self.ahead_t.shape)}",
            )
        if self.ahead_dt.shape != self.ahead_t.shape:
            raise _err(
                ErrorCode.BAD_SHAPE,
                f"ahead_dt must be [A, B] = {list(self.ahead_t.shape)}, got {list(self.ahead_dt.shape)}",
            )
        if ((self.ahead_t < 0) | (self.ahead_t > 1)).any():
            raise _err(ErrorCode.BAD_REQUEST, "ahead_t must lie in [0, 1] (t=0 noise, t=1 data)")
        if self.x_t.dtype != np.float32:
            raise _err(ErrorCode.BAD_DTYPE, f"a request that runs ahead carries x_t in float32, got {self.x_t.dtype}")


class StepReply(Message):
    """Expert worker -> coordinator: velocity [B, C, H, W] for the request's rows, in order
    (float32, or the request's `reply_dtype`)."""

    kind: Literal["step_reply"] = "step_reply"
    expert: int = Field(ge=0)
    velocity: FiniteTensor
    row_ids: list[Id] = Field(default_factory=list)
    backend: str = ""
    device: str = ""
    worker_id: str = ""
    compute_ms: float = Field(default=0.0, ge=0)
    # rows in the forward pass this request rode in (its padded bucket, or the rows themselves where
    # the worker does not pad)
    batch_rows: int = Field(default=0, ge=0)
    # which velocity of a request that runs ahead this is: 0 the step asked for, a the a-th step after it
    ahead_index: int = Field(default=0, ge=0, le=MAX_RUN_AHEAD)

    @model_serializer(mode="wrap")
    def _omit_first_index(self, handler):  # not on the wire unless running ahead: older coordinators refuse it
        out = handler(self)
        if isinstance(out, dict) and self.ahead_index == 0:
            out.pop("ahead_index", None)
        return out

    @model_validator(mode="after")
    def _check(self) -> StepReply:
        _need_float(self.velocity, "velocity")
        if self.velocity.ndim != 4:
            raise _err(ErrorCode.BAD_SHAPE, f"velocity must be [B, C, H, W], got {list(self.velocity.shape)}")
        if self.row_ids and len(self.row_ids) != self.velocity.shape[0]:
            raise _err(ErrorCode.BAD_SHAPE, f"{len(self.row_ids)} row_ids for {self.velocity.shape[0]} velocity rows")
        return self


class DecodeRequest(Message):
    """Coordinator -> decoder (on `ddm.v1.decoder.<hash>.decode`): latents [B, c, h, w] -> images.

    decoder: the content hash of the autoencoder the latents belong to (the subject's token; a
    decoder of another autoencoder answers `bad_request`). deadline: unix time (s) after which the
    decoder drops the request (`deadline_exceeded`) instead of computing it."""

    kind: Literal["decode_request"] = "decode_request"
    decoder: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    latents: FiniteTensor
    request_id: Id | None = None
    deadline: float | None = None

    @model_validator(mode="after")
    def _check(self) -> DecodeRequest:
        _need_float(self.latents, "latents")
        if self.latents.ndim != 4 or self.latents.shape[0] == 0:
            raise _err(ErrorCode.BAD_SHAPE, f"latents must be [B, c, h, w] with B >= 1, got {list(self.latents.shape)}")
        if self.latents.shape[0] > MAX_STEP_ROWS:
            raise _err(ErrorCode.TOO_LARGE, f"{self.latents.shape[0]} rows exceed the limit of {MAX_STEP_ROWS}")
        return self


class DecodeReply(Message):
    """Decoder -> coordinator: images [B, C, H, W] float32 in the autoencoder's value range, in the
    request's row order."""

    kind: Literal["decode_reply"] = "decode_reply"
    decoder: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    images: FiniteTensor
    worker_id: str = ""
    device: str = ""
    compute_ms: float = Field(default=0.0, ge=0)

    @model_validator(mode="after")
    def _check(self) -> DecodeReply:
        _need_float(self.images, "images")
        if self.images.ndim != 4:
            raise _err(ErrorCode.BAD_SHAPE, f"images must be [B, C, H, W], got {list(self.images.shape)}")
        return self


class ErrorReply(Message):
    """Any server -> client: the request failed. `code` is an ErrorCode value."""

    kind: Literal["error"] = "error"
    code: Code
    message: Text
    request_id: str | None = None


# ---------------------------------------------------------------- generation jobs


def _present_scale(schema: dict) -> None:
    """The wire form of `guidance_scale`: absent (the fleet's default) or a number in [0, MAX_GUIDANCE_SCALE];
    nil is refused (the field is None in the class only for "absent")."""
    schema.pop("anyOf", None)
    schema.pop("default", None)
    schema.update(type="number", minimum=0, maximum=MAX_GUIDANCE_SCALE)


class JobRequest(Message):
    """Client -> coordinator (on `ddm.v1.c.<client>.jobs.submit`): generate images.

    Exactly one of `labels` (the class of each image, 0 to the fleet's class count - 1, or -1 =
    label unknown: an unconditional image, the router alone picks the experts), `digits` (the v1
    spelling of `labels`, limited to 0-9 and -1; kept so v1 clients work unchanged) or `count`
    (that many random classes, drawn from `seed`). Events of a job name its labels the way the
    request did: `labels` for a `labels` request, `digits` otherwise (as in v1). `strategy` "oracle"
    needs every label, so it refuses -1 rows (`UNCONDITIONAL`). Subscribe to `ddm.v1.c.<client>.jobs.<job_id>.events`
    *before* submitting when you choose `job_id` yourself, so no event is missed.
    `session` (optional, 1-64 of [A-Za-z0-9_-]): a sub-client tag for fair sharing, e.g. one
    per viewer socket; the scheduler's fairness key is "<client>/<session>" when given, else
    "<client>". It does not change who owns the job (the client token of the subject does).
    """

    kind: Literal["job_request"] = "job_request"
    job_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    digits: list[Annotated[int, Field(ge=UNCONDITIONAL, le=9)]] | None = None
    labels: list[Annotated[int, Field(ge=UNCONDITIONAL, lt=MAX_CLASSES)]] | None = None
    count: int | None = Field(default=None, ge=1, le=MAX_JOB_IMAGES)
    steps: int = Field(default=40, ge=1, le=MAX_JOB_STEPS)
    solver: Solver = "euler"
    strategy: Strategy = "top1"
    top_k: int = Field(default=2, ge=1, le=64)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stream: bool = True
    frame_every: int = Field(default=1, ge=1, le=MAX_JOB_STEPS)
    deadline_s: float | None = Field(default=None, gt=0, le=3600)
    session: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    frame_x1: bool = False  # frames also carry x1, the model's estimate of the final sample
    report_dtypes: bool = False  # done / job_status also carry expert_dtypes (what each expert computed in)
    report_epoch: bool = False  # every event and job_status of the job also carries `epoch` (its owner epoch)
    # latent fleets only: frames whose step is a multiple of this (and the last) also carry `preview`
    # (the decoded images); None = no previews
    preview_every: int | None = Field(default=None, ge=1, le=MAX_JOB_STEPS)
    return_latents: bool = False  # latent fleets only: `done` also carries `latents` (the final samples)
    # the client can put a `done` sent in parts back together: a `done` too large for one message comes as
    # `done_part` events (its images, then its latents) and a `done` that counts them (`DoneEvent.parts`)
    image_parts: bool = False
    # classifier-free guidance scale s (`flow.guidance`): 1 = off; only with experts that have a null label.
    # None (left out): the fleet's default scale (`models.fleet_guidance`; 1 for a fleet that names none)
    guidance_scale: float | None = Field(default=None, json_schema_extra=_present_scale)

    @field_validator("guidance_scale", mode="before")
    @classmethod
    def _check_guidance_scale(cls, value: Any) -> Any:
        if value is None:  # one way to leave the choice to the fleet: leave the key out
            raise _err(
                ErrorCode.BAD_REQUEST,
                "guidance_scale must be a number (1 = no guidance); leave it out for the fleet's default",
            )
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not (0.0 <= float(value) <= MAX_GUIDANCE_SCALE):  # NaN fails this too
                raise _err(
                    ErrorCode.BAD_REQUEST,
                    f"guidance_scale must be a finite number in [0, {MAX_GUIDANCE_SCALE:g}] (1 = no guidance, "
                    f"the usual range 1.5-7), got {value!r}",
                )
        return value

    @model_serializer(mode="wrap")
    def _omit_new_defaults(self, handler):  # not on the wire unless used: older coordinators refuse unknown keys
        out = handler(self)
        if isinstance(out, dict):
            if self.guidance_scale is None:
                out.pop("guidance_scale", None)
            if not self.frame_x1:
                out.pop("frame_x1", None)
            if not self.report_dtypes:
                out.pop("report_dtypes", None)
            if not self.report_epoch:
                out.pop("report_epoch", None)
            if self.preview_every is None:
                out.pop("preview_every", None)
            if not self.return_latents:
                out.pop("return_latents", None)
            if not self.image_parts:
                out.pop("image_parts", None)
            if self.labels is None:
                out.pop("labels", None)
        return out

    @model_validator(mode="after")
    def _check(self) -> JobRequest:
        given = [name for name in ("labels", "digits", "count") if getattr(self, name) is not None]
        if len(given) != 1:
            raise _err(
                ErrorCode.BAD_REQUEST,
                "give exactly one of labels (a list of class labels), digits (its v1 "
                f"spelling, 0-9) or count; got {' and '.join(given) or 'none'}",
            )
        classes, field = self.classes, self.label_field
        if classes is not None:
            if not classes:
                raise _err(ErrorCode.BAD_REQUEST, f"{field} must not be empty")
            if len(classes) > MAX_JOB_IMAGES:
                raise _err(
                    ErrorCode.TOO_LARGE, f"{len(classes)} images requested; the limit is {MAX_JOB_IMAGES} per job"
                )
            if self.strategy == "oracle" and self.n_unconditional:
                rows = [i for i, d in enumerate(classes) if d == UNCONDITIONAL]
                raise _err(
                    ErrorCode.BAD_REQUEST,
                    (
                        f"strategy oracle needs each image's class (it runs the expert whose partition owns it), but "
                        f"{len(rows)} of {len(classes)} {field} are {UNCONDITIONAL} (label unknown), "
                        f"e.g. row {rows[0]}: "
                        "use strategy top1, topk, full or sample for unconditional images"
                    ),
                )
        return self

    @property
    def classes(self) -> list[int] | None:
        """The class of each image as requested (`labels`, or the v1 `digits`); None for `count` jobs."""
        return self.labels if self.labels is not None else self.digits

    @property
    def label_field(self) -> str:
        """The name this request gave its labels under, which its events use too: "labels" or "digits"."""
        return "labels" if self.labels is not None else "digits"

    @property
    def n_images(self) -> int:
        classes = self.classes
        return len(classes) if classes is not None else int(self.count or 0)

    @property
    def n_unconditional(self) -> int:
        """Rows whose label is unknown (-1): the router alone picks their experts."""
        classes = self.classes
        return sum(1 for d in classes if d == UNCONDITIONAL) if classes is not None else 0

    @property
    def n_guided(self) -> int:
        """Rows that classifier-free guidance doubles (each evaluated with its label and the null label):
        the rows with a known label when `guidance_scale` is not 1, else 0."""
        return 0 if self.guidance == 1.0 else self.n_images - self.n_unconditional

    @property
    def guidance(self) -> float:
        """The scale this request asks for: `guidance_scale`, or 1 (off) when it leaves the choice to the
        fleet and no coordinator has filled in the fleet's default (`Coordinator.with_fleet_defaults`)."""
        return 1.0 if self.guidance_scale is None else float(self.guidance_scale)


class _Labelled(Message):
    """An event that carries each image's label: under `labels` when the job's request used
    `labels`, else under `digits` (v1). Exactly one of the two is set; the other is left off the wire."""

    digits: list[int] | None = None
    labels: list[int] | None = None

    @model_serializer(mode="wrap")
    def _omit_unused_label_field(self, handler):
        out = handler(self)
        if isinstance(out, dict):
            out.pop("labels" if self.labels is None else "digits", None)
            if getattr(self, "epoch", 0) is None:  # not on the wire unless asked: older clients refuse unknown keys
                out.pop("epoch", None)
        return out

    @model_validator(mode="after")
    def _one_label_field(self):
        if (self.digits is None) == (self.labels is None):
            raise _err(ErrorCode.BAD_REQUEST, f"{self.kind}: give exactly one of labels or digits")
        return self

    @property
    def classes(self) -> list[int]:
        """Each image's label, whichever field carried it."""
        return self.labels if self.labels is not None else self.digits


class JobAccepted(_Labelled):
    """Coordinator -> client (reply to submit): the job is queued.

    `coordinator` / `instance`: the name of the coordinator that took the job (stable across its
    restarts) and its run ("" from a coordinator that does not say): a client believes a later
    `unknown` job status only from a coordinator of that name (see JobStatus)."""

    kind: Literal["accepted"] = "accepted"
    job_id: Id
    events_subject: str
    seed: int
    queue_position: int = 0
    coordinator: CoordinatorName = ""
    instance: CoordinatorName = ""
    epoch: Epoch | None = None  # the job's owner epoch, only when the job asked (JobRequest.report_epoch)


class JobRejected(Message):
    """Coordinator -> client (reply to submit): the job will not run."""

    kind: Literal["rejected"] = "rejected"
    code: Code
    reason: Text


class FrameEvent(Message):
    """One denoising step of a job (only if `stream`).

    x: [N, C, H, W] current samples (float16 to save bandwidth).
    t: time reached after this step.  experts: [N] expert that produced each row's
    step (-1 = several, see weights).  weights: [N, K] router weights used.
    x1: [N, C, H, W] float16, the predicted final sample x + (1 - t) * u (u: the last combined
    velocity), only when the job asked (`JobRequest.frame_x1`); else None.
    """

    kind: Literal["frame"] = "frame"
    job_id: Id
    step: int = Field(ge=0)
    steps: int = Field(ge=1)
    t: float = Field(ge=0, le=1)
    x: Tensor
    experts: list[int]
    weights: Tensor
    notes: list[str] = Field(default_factory=list)  # e.g. "row 2: expert 1 unavailable, fell back to 0"
    x1: Tensor | None = None
    preview: Tensor | None = None  # latent fleets: the decoded images of x (`JobRequest.preview_every`)
    epoch: Epoch | None = None  # the job's owner epoch, only when the job asked (JobRequest.report_epoch)

    @model_serializer(mode="wrap")
    def _omit_absent_x1(self, handler):  # not on the wire unless asked: older clients refuse unknown keys
        out = handler(self)
        if isinstance(out, dict):
            if self.x1 is None:
                out.pop("x1", None)
            if self.preview is None:
                out.pop("preview", None)
            if self.epoch is None:
                out.pop("epoch", None)
        return out

    @model_validator(mode="after")
    def _check(self) -> FrameEvent:
        _need_float(self.x, "x")
        _need_float(self.weights, "weights")
        if self.x.ndim != 4:
            raise _err(ErrorCode.BAD_SHAPE, f"x must be [N, C, H, W], got shape {list(self.x.shape)}")
        n = self.x.shape[0]
        if len(self.experts) != n:
            raise _err(ErrorCode.BAD_SHAPE, f"experts has {len(self.experts)} entries for {n} images")
        if self.weights.ndim != 2 or self.weights.shape[0] != n:
            raise _err(ErrorCode.BAD_SHAPE, f"weights must be [N, K] with N = {n}, got {list(self.weights.shape)}")
        if self.step > self.steps:
            raise _err(ErrorCode.BAD_REQUEST, f"step {self.step} is past steps {self.steps}")
        if self.x1 is not None:
            _need_float(self.x1, "x1")
            if self.x1.shape != self.x.shape:
                raise _err(
                    ErrorCode.BAD_SHAPE, f"x1 must have the shape of x {list(self.x.shape)}, got {list(self.x1.shape)}"
                )
        return self

    @classmethod
    def trusted(
        cls,
        *,
        job_id: str,
        step: int,
        steps: int,
        t: float,
        x: np.ndarray,
        experts: list[int],
        weights: np.ndarray,
        notes: list[str],
        x1: np.ndarray | None = None,
    ) -> FrameEvent:
        """A frame built WITHOUT validation, for a producer that guarantees what `_check` tests
        (the coordinator's scheduler, one frame per job per step: validating took about half of a
        frame's cost). x / x1: float16 [N, C, H, W], weights: float [N, K], experts: N ints.
        Anything received from the wire goes through `unpack`, which validates."""
        return cls.model_construct(
            job_id=job_id, step=step, steps=steps, t=t, x=x, experts=experts, weights=weights, notes=notes, x1=x1
        )

    def wire_dict(self) -> dict[str, Any]:
        """What `model_dump(mode="python")` gives (same keys, order and values, so `pack` makes
        the same bytes), built directly: `pack` uses it for frames, the coordinator's most
        frequent message."""
        out = {
            "v": self.v,
            "kind": "frame",
            "job_id": self.job_id,
            "step": int(self.step),
            "steps": int(self.steps),
            "t": float(self.t),
            "x": encode_tensor(self.x),
            "experts": [int(e) for e in self.experts],
            "weights": encode_tensor(self.weights),
            "notes": list(self.notes),
        }
        if self.x1 is not None:
            out["x1"] = encode_tensor(self.x1)
        if self.preview is not None:
            out["preview"] = encode_tensor(self.preview)
        if self.epoch is not None:
            out["epoch"] = int(self.epoch)
        return out


#: one entry of `expert_dtypes`: "" (the expert computed none of the job's rows, or its workers do not
#: say), "float32", "bfloat16", or several of them comma-joined in sorted order when workers differed
ExpertDtype = Annotated[str, Field(pattern=r"^[a-z0-9,]{0,64}$")]


class DoneEvent(_Labelled):
    """Final images. images: [N, C, H, W] float32 in [-1, 1]. usage: [N, K] fraction of
    steps on which each expert contributed to each image. expert_dtypes: K entries, what each
    expert computed this job's rows in (`ExpertDtype`), only when the job asked
    (`JobRequest.report_dtypes`); else None and not on the wire (older clients refuse unknown keys).
    latents: [N, c, h, w] float32, the final samples of a latent fleet before decoding, only when the
    job asked (`JobRequest.return_latents`).
    parts: a `done` too large for one message, of a job that asked for parts (`JobRequest.image_parts`),
    carries neither `images` nor `latents` but `parts`, the number of `DonePartEvent`s published before it
    that carry them; None (not on the wire) otherwise. Exactly one of `images` and `parts` is set."""

    kind: Literal["done"] = "done"
    job_id: Id
    images: FiniteTensor | None = None
    usage: Tensor
    steps: int
    strategy: Strategy
    elapsed_s: float = Field(ge=0)
    notes: list[str] = Field(default_factory=list)
    expert_dtypes: list[ExpertDtype] | None = None
    latents: FiniteTensor | None = None
    epoch: Epoch | None = None  # the job's owner epoch, only when the job asked (JobRequest.report_epoch)
    parts: int | None = Field(default=None, ge=1, le=MAX_DONE_PARTS)

    @model_serializer(mode="wrap")
    def _omit_unused_label_field(self, handler):  # replaces _Labelled's (one model serializer per model)
        out = handler(self)
        if isinstance(out, dict):
            out.pop("labels" if self.labels is None else "digits", None)
            # not on the wire unless asked (older clients refuse unknown keys), or, for images, sent in parts
            for key in ("images", "expert_dtypes", "latents", "epoch", "parts"):
                if getattr(self, key) is None:
                    out.pop(key, None)
        return out

    @model_validator(mode="after")
    def _check(self) -> DoneEvent:
        if (self.images is None) == (self.parts is None):
            raise _err(
                ErrorCode.BAD_REQUEST,
                "done: give exactly one of images (the images) or parts (how many done_part events carry them)",
            )
        if self.parts is not None and self.latents is not None:
            raise _err(ErrorCode.BAD_REQUEST, "done: a done sent in parts carries its latents in parts, not in latents")
        _need_float(self.usage, "usage")
        n = len(self.classes)
        if self.images is not None:
            _need_float(self.images, "images")
            if self.images.ndim != 4:
                raise _err(ErrorCode.BAD_SHAPE, f"images must be [N, C, H, W], got shape {list(self.images.shape)}")
            n = self.images.shape[0]
            if len(self.classes) != n:
                field = "labels" if self.labels is not None else "digits"
                raise _err(ErrorCode.BAD_SHAPE, f"{field} has {len(self.classes)} entries for {n} images")
        if self.usage.ndim != 2 or self.usage.shape[0] != n:
            raise _err(ErrorCode.BAD_SHAPE, f"usage must be [N, K] with N = {n}, got {list(self.usage.shape)}")
        if self.expert_dtypes is not None and len(self.expert_dtypes) != self.usage.shape[1]:
            raise _err(
                ErrorCode.BAD_SHAPE,
                f"expert_dtypes has {len(self.expert_dtypes)} entries for {self.usage.shape[1]} experts",
            )
        return self


class DonePartEvent(Message):
    """One part of a `done` too large for one message (`JobRequest.image_parts`), published before that
    `done` on the job's events subject: rows [start, start + m) of the done's `images` or `latents`
    (exactly one of the two, [m, C, H, W] float, finite), of `total` rows (the job's N images). `part`
    numbers it among the `parts` parts of the done (its images first, then its latents), which the done
    counts too (`DoneEvent.parts`)."""

    kind: Literal["done_part"] = "done_part"
    job_id: Id
    part: int = Field(ge=0, lt=MAX_DONE_PARTS)
    parts: int = Field(ge=1, le=MAX_DONE_PARTS)
    start: int = Field(ge=0, lt=MAX_JOB_IMAGES)
    total: int = Field(ge=1, le=MAX_JOB_IMAGES)
    images: FiniteTensor | None = None
    latents: FiniteTensor | None = None
    epoch: Epoch | None = None  # the job's owner epoch, only when the job asked (JobRequest.report_epoch)

    @model_serializer(mode="wrap")
    def _omit_absent(self, handler):
        out = handler(self)
        if isinstance(out, dict):
            for key in ("images", "latents", "epoch"):
                if getattr(self, key) is None:
                    out.pop(key, None)
        return out

    @model_validator(mode="after")
    def _check(self) -> DonePartEvent:
        if (self.images is None) == (self.latents is None):
            raise _err(ErrorCode.BAD_REQUEST, "done_part: give exactly one of images or latents")
        field = self.field
        rows = self.rows
        _need_float(rows, field)
        if rows.ndim != 4 or rows.shape[0] < 1:
            raise _err(ErrorCode.BAD_SHAPE, f"{field} must be [m, C, H, W] with m >= 1, got shape {list(rows.shape)}")
        if self.part >= self.parts:
            raise _err(ErrorCode.BAD_REQUEST, f"done_part: part {self.part} of {self.parts} parts (numbered from 0)")
        if self.start + rows.shape[0] > self.total:
            raise _err(
                ErrorCode.BAD_SHAPE,
                f"done_part: {field} rows {self.start} to {self.start + rows.shape[0] - 1} are past the "
                f"job's {self.total} images",
            )
        return self

    @property
    def field(self) -> str:
        """The `done` field this part is a slice of: "images" or "latents"."""
        return "images" if self.images is not None else "latents"

    @property
    def rows(self) -> np.ndarray:
        """The rows it carries ([m, C, H, W]), whichever field."""
        return self.images if self.images is not None else self.latents


class FailedEvent(Message):
    kind: Literal["failed"] = "failed"
    job_id: Id
    code: Code
    reason: Text
    epoch: Epoch | None = None  # the job's owner epoch, only when the job asked (JobRequest.report_epoch)

    @model_serializer(mode="wrap")
    def _omit_absent_epoch(self, handler):  # not on the wire unless asked: older clients refuse unknown keys
        out = handler(self)
        if isinstance(out, dict) and self.epoch is None:
            out.pop("epoch", None)
        return out


class CancelRequest(Message):
    """Client -> coordinator on `ddm.v1.c.<client>.jobs.<job_id>.cancel`."""

    kind: Literal["cancel"] = "cancel"
    job_id: Id


class CancelReply(Message):
    kind: Literal["cancel_reply"] = "cancel_reply"
    job_id: Id
    cancelled: bool
    reason: str = ""


JobState = Literal["queued", "running", "done", "failed", "unknown"]


class JobStatus(Message):
    """Coordinator -> client (reply on `ddm.v1.c.<client>.jobs.<job_id>.status`): what it knows of the job.

    queued / running: the job is alive (step = steps completed, queue_position = its place in
    the queue, 1 = next). done / failed: it finished recently, and its terminal event has just
    been published again on the events subject (for a client that missed it, e.g. across a
    NATS reconnect). unknown: this coordinator has no such job: it never had it, forgot it long
    after it finished, or was restarted since (the job is lost). Every coordinator answers, so
    `coordinator` (its name) and `instance` (its run) say who: a client takes `unknown` as lost
    only from the coordinator named in the job's `accepted` (itself, or its restart)."""

    kind: Literal["job_status"] = "job_status"
    job_id: Id
    state: JobState
    step: int = Field(default=0, ge=0)
    steps: int = Field(default=0, ge=0)
    queue_position: int = Field(default=0, ge=0)
    coordinator: str = ""
    instance: CoordinatorName = ""
    #: K entries, what each expert computed the job's rows in so far (as `DoneEvent.expert_dtypes`),
    #: only for a job that asked (`JobRequest.report_dtypes`); else None and not on the wire
    expert_dtypes: list[ExpertDtype] | None = None
    #: the job's owner epoch as this coordinator holds it, only for a job that asked (`JobRequest.report_epoch`)
    #: and that this coordinator knows; else None and not on the wire
    epoch: Epoch | None = None
    #: the job's classifier-free guidance scale (`JobRequest.guidance_scale`), only for a queued or running job
    #: that asked for one other than 1 (a client that never sends one never sees it); else None, not on the wire
    guidance_scale: float | None = Field(default=None, ge=0, le=MAX_GUIDANCE_SCALE)

    @model_serializer(mode="wrap")
    def _omit_absent_dtypes(self, handler):  # older clients refuse unknown keys
        out = handler(self)
        if isinstance(out, dict):
            if self.guidance_scale is None:
                out.pop("guidance_scale", None)
            if self.expert_dtypes is None:
                out.pop("expert_dtypes", None)
            if self.epoch is None:
                out.pop("epoch", None)
        return out


class RejectedWorkerInfo(BaseModel):
    """A worker on the bus that the coordinator does not use: its model spec differs from the fleet's
    (`FleetStatus.rejected_workers`)."""

    model_config = ConfigDict(extra="forbid")

    worker_id: str = Field(max_length=128)
    service_id: str = Field(max_length=64)
    host: str = Field(max_length=128)
    expert: int
    differs: str = Field(max_length=1000)


class FleetStatus(Message):
    """Coordinator -> anyone (reply on `ddm.v1.fleet.status`): a load snapshot.

    rows_per_s: row velocity evaluations per second over the last seconds;
    unavailable_experts: experts whose last call failed (no responders / timeouts)."""

    kind: Literal["fleet_status"] = "fleet_status"
    coordinator: str = ""
    active_jobs: int = Field(default=0, ge=0)
    active_rows: int = Field(default=0, ge=0)
    queued_jobs: int = Field(default=0, ge=0)
    max_rows: int = Field(default=0, ge=0)
    max_queued_jobs: int = Field(default=0, ge=0)
    num_experts: int = Field(default=0, ge=0)
    jobs_submitted: int = Field(default=0, ge=0)
    jobs_done: int = Field(default=0, ge=0)
    jobs_failed: int = Field(default=0, ge=0)
    jobs_cancelled: int = Field(default=0, ge=0)
    jobs_rejected: int = Field(default=0, ge=0)
    images_done: int = Field(default=0, ge=0)
    ticks: int = Field(default=0, ge=0)
    rows_per_s: float = Field(default=0.0, ge=0)
    tick_ms_p50: float = Field(default=0.0, ge=0)
    uptime_s: float = Field(default=0.0, ge=0)
    unavailable_experts: list[int] = Field(default_factory=list)
    #: the fleet's model spec (`schemas.spec.ModelSpec`), only when the status request asked for it
    #: (a map with "spec": true), so that v1 clients, which refuse unknown keys, never see it
    spec: ModelSpec | None = None
    #: workers on the bus whose spec differs from the fleet's (not used), sent with `spec` only (same opt-in)
    rejected_workers: list[RejectedWorkerInfo] | None = None
    #: the classifier-free guidance scale a job that names none gets (the coordinator's default, from its
    #: --default-guidance or the router.json of its checkpoints; 1.0: no guidance), sent with `spec` only
    default_guidance_scale: float | None = Field(default=None, ge=0, le=MAX_GUIDANCE_SCALE)

    @model_serializer(mode="wrap")
    def _omit_spec_unless_asked(self, handler):
        out = handler(self)
        if isinstance(out, dict):
            for key in ("spec", "rejected_workers", "default_guidance_scale"):
                if getattr(self, key) is None:
                    out.pop(key, None)
        return out


JobEvent = Annotated[JobAccepted | FrameEvent | DonePartEvent | DoneEvent | FailedEvent, Field(discriminator="kind")]
SubmitReply = Annotated[JobAccepted | JobRejected | ErrorReply, Field(discriminator="kind")]
StepResult = Annotated[StepReply | ErrorReply, Field(discriminator="kind")]
DecodeResult = Annotated[DecodeReply | ErrorReply, Field(discriminator="kind")]
