"""The browser <-> web-server websocket protocol: parse what the page sends.

Every message is one JSON object with a `type`. Client -> server:

    {"type": "generate", "digits": "3,7,7" | [3, 7, 7]}            one image per digit
    {"type": "generate", "count": 8, "steps": 40, "strategy": "top1", "solver": "euler",
     "top_k": 2, "seed": "1", "frame_every": 1, "ref": "anything"} `count` random digits
                                                         (seed: int or decimal string)
    {"type": "generate", "digits": "3", "deadline_s": 30}          fail the job (deadline_exceeded)
                                                         if not done within 1-3600 s
    {"type": "generate", "digits": "3", "frame_x1": true}          frames also carry the predicted
                                                         final image x1 (JSON true/false only)
    {"type": "generate", "digits": "?,?,4" | [-1, -1, 4]}          "?" / "-1" / -1: no digit (label
                                                         unknown, unconditional: the router alone picks the
                                                         experts); not with strategy "oracle"
    {"type": "generate", "labels": "cat, dog, ?" | "3 5" | [3, 5, -1]}  one image per class of the
                                                         fleet's spec: class names or indices 0..num_classes-1
                                                         (on the MNIST fleet exactly what `digits` takes)
    {"type": "generate", "digits": "3", "guidance_scale": 3}        classifier-free guidance at scale 0-20
                                                         (a JSON number; 1 = off, the page omits it then);
                                                         the fleet's experts need a null label
    {"type": "cancel", "job_id": "web..."}                          cancel one of *this* socket's jobs
    {"type": "ping"}                                                 answered with {"type": "pong"}

Server -> client: `hello`, `spec`, `accepted`, `frame`, `done`, `failed`, `rejected`, `cancelled`,
`fleet`, `error`, `pong` (see `web/session.py`, `web/spec.py` and `web/frames.py` for their fields).

Labels are read against the fleet's spec (`web/spec.py`); the job request names them `digits` on a fleet of
ten classes (what every coordinator takes) and `labels` on any other (`web.spec.wire_label_field`).

Nothing here touches the network: `parse_client_message` turns text into a typed command
or raises `BadInput` whose message is shown to the user as is. Job parameters are validated
by `schemas.JobRequest`, so its limits (images per job, steps) and its pydantic messages are
the ones the user sees.
"""

from __future__ import annotations

import json
import re
import reprlib
from dataclasses import dataclass
from typing import Any

from schemas import MAX_JOB_IMAGES, PROTOCOL_VERSION, UNCONDITIONAL, JobRequest, ProtocolError, validate
from schemas.limits import MAX_GUIDANCE_SCALE
from schemas.spec import MAX_CLASS_NAME_LEN, ModelSpec, legacy_spec

from .spec import class_names, is_digit_fleet, wire_label_field

#: Largest websocket text message the server reads (bytes); larger ones close the socket.
MAX_CLIENT_MESSAGE_BYTES = 256 * 1024

#: Job parameters a page may set; everything else in a `generate` message is refused.
GENERATE_FIELDS = (
    "labels",
    "digits",
    "count",
    "steps",
    "strategy",
    "solver",
    "top_k",
    "seed",
    "frame_every",
    "deadline_s",
    "frame_x1",
    "guidance_scale",
)

#: Bounds of a page's `deadline_s` (seconds from the submit; JobRequest.deadline_s).
MIN_DEADLINE_S, MAX_DEADLINE_S = 1, 3600

#: Longest `digits` string parsed: MAX_JOB_IMAGES digits with generous separators. Checked before splitting,
#: so an oversized string costs a length check, not a split of 256 KiB.
MAX_DIGITS_CHARS = 8 * MAX_JOB_IMAGES + 64

#: Longest `labels` string parsed: MAX_JOB_IMAGES class names of the longest length, with separators.
MAX_LABELS_CHARS = (MAX_CLASS_NAME_LEN + 2) * MAX_JOB_IMAGES + 64

_SPLIT = re.compile(r"[\s,;]+")
_SPLIT_LIST = re.compile(r"\s*[,;]\s*")
#: Tokens of a `digits` string that mean "no digit" (label unknown): the page's "?" and the wire's -1.
NO_DIGIT_TOKENS = ("?", "-1")
#: The spec labels are read against when none is given: the MNIST fleet's.
MNIST_SPEC = legacy_spec()
_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 40


class BadInput(ValueError):
    """Input the user (or a misbehaving page) sent; `str(err)` is shown to them verbatim.
    `ref` echoes the client's correlation field when the message had one."""

    def __init__(self, message: str, *, ref: Any = None, code: str = "bad_request"):
        super().__init__(message)
        self.message = message
        self.ref = ref
        self.code = code


@dataclass(frozen=True)
class Generate:
    """Submit a job. `request.job_id` is still None: the session picks it."""

    request: JobRequest
    ref: Any = None


@dataclass(frozen=True)
class Cancel:
    job_id: str
    ref: Any = None


@dataclass(frozen=True)
class Ping:
    ref: Any = None


ClientMessage = Generate | Cancel | Ping


def parse_digits(value: Any) -> list[int]:
    """'3,7,7' / '3 7 7' / [3, 7, 7] -> [3, 7, 7]. Each entry is one digit 0-9, or "no digit"
    (label unknown, an unconditional image): "?" or "-1" in a string, -1 in a list -> -1
    (`schemas.UNCONDITIONAL`).

    Raises BadInput naming the first offending entry. Input far over the count limit is refused
    before it is split or walked (length check); the exact count limit is `JobRequest`'s.
    """
    if isinstance(value, str):
        if len(value) > MAX_DIGITS_CHARS:
            raise BadInput(
                f"digits: {len(value)} characters is far too long; the limit is {MAX_JOB_IMAGES} images per job"
            )
        tokens = [tok for tok in _SPLIT.split(value.strip()) if tok]
        if not tokens:
            raise BadInput("enter at least one digit, e.g. 3,7,7")
        out = []
        for tok in tokens:
            if tok in NO_DIGIT_TOKENS:
                out.append(UNCONDITIONAL)
                continue
            if len(tok) != 1 or tok not in "0123456789":
                shown = tok if len(tok) <= 12 else tok[:12] + "…"
                raise BadInput(
                    f"{shown!r} is not a digit: enter digits 0-9 separated by commas, e.g. 3,7,7 (? for no digit)"
                )
            out.append(int(tok))
        return out
    if isinstance(value, list):
        out = []
        for item in value:
            if isinstance(item, bool) or not isinstance(item, int) or not UNCONDITIONAL <= item <= 9:
                raise BadInput(f"digits must be integers 0-9, got {_shown(item)} (or {UNCONDITIONAL}: no digit)")
            out.append(item)
        return out
    raise BadInput(f"digits must be a string like '3,7,7' or a list of integers, got {type(value).__name__}")


def parse_labels(value: Any, spec: ModelSpec | None = None) -> list[int]:
    """The classes of a `labels` entry against the fleet's spec -> [class index or -1, ...].

    A string lists class names or indices 0..num_classes-1, separated by commas or semicolons (names may
    hold spaces then: "aquarium fish, apple") or else by spaces; "?" or "-1" is "label unknown" (-1). A
    token is first looked up as a class name (exactly, then ignoring case when that is unambiguous), then
    read as an index. A list holds indices (-1 allowed) or names. On the MNIST fleet (classes "0"-"9") this
    is `parse_digits`, with its messages. Raises BadInput naming the first offending entry."""
    spec = spec if spec is not None else MNIST_SPEC
    if is_digit_fleet(spec):
        return parse_digits(value)
    names = _NameIndex.of(spec)
    n = len(names)
    if isinstance(value, str):
        if len(value) > MAX_LABELS_CHARS:
            raise BadInput(
                f"labels: {len(value)} characters is far too long; the limit is {MAX_JOB_IMAGES} images per job"
            )
        text = value.strip()
        tokens = _SPLIT_LIST.split(text) if ("," in text or ";" in text) else text.split()
        tokens = [tok.strip() for tok in tokens if tok.strip()]
        if not tokens:
            raise BadInput(f"enter at least one class, e.g. {_example(names)}")
        return [_label_of(tok, names) for tok in tokens]
    if isinstance(value, list):
        out = []
        for item in value:
            if isinstance(item, str):
                out.append(_label_of(item.strip(), names))
            elif isinstance(item, bool) or not isinstance(item, int) or not UNCONDITIONAL <= item < n:
                raise BadInput(
                    f"labels must be class indices 0-{n - 1} or class names, got {_shown(item)} "
                    f"(or {UNCONDITIONAL}: label unknown)"
                )
            else:
                out.append(item)
        return out
    raise BadInput(f"labels must be a string like {_example(names)!r} or a list, got {type(value).__name__}")


class _NameIndex(list):
    """A spec's class names with lookups by name and by case-folded name (None: ambiguous), built once
    per spec (a fleet may have up to MAX_CLASSES classes; a job names up to MAX_JOB_IMAGES of them)."""

    _cache: dict[int, tuple[ModelSpec, _NameIndex]] = {}

    def __init__(self, names: list[str]):
        super().__init__(names)
        self.exact = {name: i for i, name in reversed(list(enumerate(names)))}
        self.folded: dict[str, int | None] = {}
        for i, name in enumerate(names):
            key = name.casefold()
            self.folded[key] = None if key in self.folded else i

    @classmethod
    def of(cls, spec: ModelSpec) -> _NameIndex:
        hit = cls._cache.get(id(spec))
        if hit is None or hit[0] is not spec:
            if len(cls._cache) >= 4:
                cls._cache.clear()
            hit = cls._cache[id(spec)] = (spec, cls(class_names(spec)))
        return hit[1]


def _label_of(token: str, names: _NameIndex) -> int:
    """One token of a labels string -> its class index (-1 for "?" / "-1"); BadInput if it names no class."""
    if token in NO_DIGIT_TOKENS:
        return UNCONDITIONAL
    if token in names.exact:
        return names.exact[token]
    folded = names.folded.get(token.casefold())
    if folded is not None:
        return folded
    if token.isascii() and token.isdigit() and len(token) <= 6 and int(token) < len(names):
        return int(token)
    shown = token if len(token) <= 24 else token[:24] + "…"
    if not names:
        raise BadInput(f"{shown!r}: this fleet is unconditional (no classes): use ? or a count of random images")
    raise BadInput(
        f"{shown!r} is not a class of this fleet: enter class names or numbers 0-{len(names) - 1} separated by "
        f"commas, e.g. {_example(names)} (? for label unknown)"
    )


def _example(names: list[str]) -> str:
    return ",".join(names[:3]) if names else "?"


def _check_classes(classes: list[int], spec: ModelSpec, field: str, ref: Any) -> None:
    """Every class index must be one of the fleet's (the coordinator would refuse it too, less plainly)."""
    n = spec.num_classes
    bad = next((c for c in classes if c != UNCONDITIONAL and not 0 <= c < n), None)
    if bad is not None:
        what = f"classes 0-{n - 1}" if n else "no classes (it is unconditional): use ?"
        raise BadInput(f"{field}: {bad} is not a class of this fleet, which has {what}", ref=ref)


def _refuse_oracle_without_labels(digits: list[int], strategy: Any, ref: Any) -> None:
    """Routing "oracle" runs the expert whose partition owns each image's digit: an image with no
    digit (-1) has none. Raises BadInput saying so and what to pick instead."""
    unknown = [i for i, d in enumerate(digits) if d == UNCONDITIONAL]
    if strategy == "oracle" and unknown:
        verb = "has" if len(unknown) == 1 else "have"
        raise BadInput(
            f"routing oracle (by label) needs every image's digit, but {len(unknown)} of {len(digits)} "
            f"images {verb} no digit (? / {UNCONDITIONAL}, e.g. image {unknown[0]}): choose top-1, top-k "
            "or full ensemble for unconditional images",
            ref=ref,
        )


def _job_request(msg: dict[str, Any], ref: Any, spec: ModelSpec) -> JobRequest:
    unknown = sorted(set(msg) - set(GENERATE_FIELDS) - {"type", "ref"})
    if unknown:
        shown = ", ".join(_shown(name) if len(str(name)) > 40 else str(name) for name in unknown[:8])
        more = f" (and {len(unknown) - 8} more)" if len(unknown) > 8 else ""
        raise BadInput(f"unknown field(s) in generate: {shown}{more}; allowed: {', '.join(GENERATE_FIELDS)}", ref=ref)
    fields = {k: msg[k] for k in GENERATE_FIELDS if k in msg and msg[k] not in (None, "")}
    seed = fields.get("seed")
    if isinstance(seed, str) and seed.strip().isascii() and seed.strip().isdigit() and len(seed.strip()) <= 20:
        fields["seed"] = int(seed)  # the page sends seeds as text: JS numbers lose digits past 2**53
    if "deadline_s" in fields:
        fields["deadline_s"] = _deadline(fields["deadline_s"], ref)
    if "guidance_scale" in fields:
        fields["guidance_scale"] = _guidance_scale(fields["guidance_scale"], ref)
    given = [name for name in ("labels", "digits") if name in fields]
    if len(given) == 2:
        raise BadInput("give labels or digits, not both", ref=ref)
    if given:
        field = given[0]
        try:
            classes = parse_labels(fields.pop(field), spec) if field == "labels" else parse_digits(fields.pop(field))
        except BadInput as err:
            raise BadInput(err.message, ref=ref) from None
        _check_classes(classes, spec, field, ref)
        _refuse_oracle_without_labels(classes, fields.get("strategy"), ref)
        fields[wire_label_field(spec)] = classes
    try:  # strict, like the wire: the page sends numbers as JSON numbers
        return validate({"v": PROTOCOL_VERSION, "kind": "job_request", **fields}, JobRequest)
    except ProtocolError as err:
        raise BadInput(err.message, ref=ref, code=err.code.value) from None


def _deadline(value: Any, ref: Any) -> float:
    """A page's `deadline_s`: a JSON number (not a string, not a boolean) from MIN_DEADLINE_S to
    MAX_DEADLINE_S seconds. Raises BadInput saying the bounds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise BadInput(
            f"deadline_s must be a number of seconds ({MIN_DEADLINE_S}-{MAX_DEADLINE_S}), got {_shown(value)}", ref=ref
        )
    if not MIN_DEADLINE_S <= value <= MAX_DEADLINE_S:
        raise BadInput(f"deadline_s must be {MIN_DEADLINE_S}-{MAX_DEADLINE_S} seconds, got {_shown(value)}", ref=ref)
    return float(value)


def _guidance_scale(value: Any, ref: Any) -> float:
    """A page's `guidance_scale`: a finite JSON number (not a string, not a boolean) from 0 to
    MAX_GUIDANCE_SCALE; 1 is no guidance (also on a fleet with a default scale; a page that sends none gets the
    fleet's default). Raises BadInput saying
    the bounds. Whether the fleet can guide (its experts need a null label) is the coordinator's to say."""
    bounds = f"0-{MAX_GUIDANCE_SCALE:g}, 1 = off"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadInput(f"guidance_scale must be a number ({bounds}), got {_shown(value)}", ref=ref)
    if not 0 <= value <= MAX_GUIDANCE_SCALE:  # NaN and the infinities (json.loads reads them) fail this too
        raise BadInput(f"guidance_scale must be {bounds}, got {_shown(value)}", ref=ref)
    return float(value)


def parse_client_message(text: Any, spec: ModelSpec | None = None) -> ClientMessage:
    """One websocket text frame -> a command; labels are read against the fleet's `spec` (None: the
    MNIST fleet's, `legacy_spec()`). Raises BadInput for anything else."""
    if not isinstance(text, str):
        raise BadInput("send JSON text frames, not binary")
    try:
        msg = json.loads(text)
    except (ValueError, RecursionError) as err:  # JSONDecodeError, an int literal over 4300 digits, deep nesting
        raise BadInput(f"malformed JSON: {err}") from None
    if not isinstance(msg, dict):
        raise BadInput(f"each message must be a JSON object with a 'type', got {type(msg).__name__}")
    ref = msg.get("ref")
    if ref is not None and not (isinstance(ref, (str, int)) and not isinstance(ref, bool) and len(str(ref)) <= 64):
        raise BadInput("ref must be a short string or integer")
    kind = msg.get("type")
    if kind == "generate":
        return Generate(_job_request(msg, ref, spec if spec is not None else MNIST_SPEC), ref)
    if kind == "cancel":
        job_id = msg.get("job_id")
        if not isinstance(job_id, str) or not job_id:
            raise BadInput("cancel needs a job_id string", ref=ref)
        return Cancel(job_id, ref)
    if kind == "ping":
        return Ping(ref)
    if kind is None:
        raise BadInput("message has no 'type'; expected generate, cancel or ping", ref=ref)
    shown = repr(kind) if isinstance(kind, str) and len(kind) <= 32 else _shown(kind)
    raise BadInput(f"unknown message type {shown}; expected generate, cancel or ping", ref=ref)


def _shown(value: Any) -> str:
    """A short repr of anything the page sent (bounded length and depth, never recursion)."""
    return _REPR.repr(value)[:80]
