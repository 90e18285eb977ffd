"""docs/protocol.schema.json: what `python -m infra.protocol_schema` generates from the message classes,
and real encoded messages (packed by the code, decoded by plain msgpack) validate against it, while
maps the code refuses (an unknown key, a wrong type, a missing field) do not."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema  # the test extra installs it
import msgpack
import numpy as np
import pytest

from infra.protocol_schema import document, main, message_classes, render
from schemas import (
    CancelReply,
    CancelRequest,
    DecodeReply,
    DecodeRequest,
    DoneEvent,
    DonePartEvent,
    ErrorCode,
    ErrorReply,
    FailedEvent,
    FleetStatus,
    FrameEvent,
    JobAccepted,
    JobRejected,
    JobRequest,
    JobStatus,
    StepReply,
    StepRequest,
    pack,
)
from schemas.spec import legacy_spec

PUBLISHED = Path(__file__).resolve().parents[2] / "docs" / "protocol.schema.json"
X = np.zeros((2, 1, 4, 4), np.float32)
HASH = "ab" * 32

SAMPLES = [
    StepRequest(expert=0, x_t=X, t=np.zeros(2, np.float32), y=np.array([1, -1]), row_ids=["a", "b"]),
    StepReply(expert=0, velocity=X, row_ids=["a", "b"], worker_id="w"),
    ErrorReply(code=ErrorCode.RATE_LIMITED, message="too many; retry in 0.50 s"),
    JobRequest(job_id="j1", digits=[1, 2], steps=10, seed=3, guidance_scale=2.0),
    JobAccepted(job_id="j1", digits=[1, 2], events_subject="ddm.v1.c.a.jobs.j1.events", seed=3),
    JobRejected(code=ErrorCode.OVERLOADED, reason="full"),
    FrameEvent(job_id="j1", step=1, steps=10, t=0.1, x=X.astype(np.float16), experts=[0, 1], weights=np.ones((2, 2))),
    DoneEvent(
        job_id="j1",
        digits=[1, 2],
        images=X,
        usage=np.ones((2, 2), np.float32),
        steps=10,
        strategy="top1",
        elapsed_s=0.5,
    ),
    FailedEvent(job_id="j1", code=ErrorCode.CANCELLED, reason="cancelled"),
    CancelRequest(job_id="j1"),
    CancelReply(job_id="j1", cancelled=False, reason="unknown job"),
    JobStatus(job_id="j1", state="running", step=3, steps=10),
    FleetStatus(num_experts=2, spec=legacy_spec()),
    DecodeRequest(decoder=HASH, latents=X, request_id="r1"),
    DecodeReply(decoder=HASH, images=X),
    DonePartEvent(job_id="j1", part=0, parts=2, start=0, total=2, images=X),  # a done too large for one message
    DoneEvent(
        job_id="j1", digits=[1, 2], parts=2, usage=np.ones((2, 2), np.float32), steps=10, strategy="top1", elapsed_s=0
    ),
]


def _as_json_value(obj):
    """A decoded msgpack value as JSON Schema sees it: bin (tensor data) -> str, as the schema says."""
    if isinstance(obj, bytes):
        return obj.decode("latin-1")
    if isinstance(obj, dict):
        return {k: _as_json_value(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_as_json_value(v) for v in obj]
    return obj


def _validator():
    return jsonschema.Draft202012Validator(document())


def test_the_published_schema_is_what_the_code_generates(tmp_path, capsys):
    assert PUBLISHED.read_text() == render(), "run: python -m infra.protocol_schema --out docs/protocol.schema.json"
    assert main(["--check", str(PUBLISHED)]) == 0
    stale = tmp_path / "old.json"
    stale.write_text(render().replace('"cancel_reply"', '"cancel_answer"'))
    assert main(["--check", str(stale)]) == 1 and "out of date" in capsys.readouterr().err
    jsonschema.Draft202012Validator.check_schema(json.loads(PUBLISHED.read_text()))


def test_every_message_kind_is_defined_and_sampled():
    kinds = set(message_classes())
    assert kinds == {m.kind for m in SAMPLES}
    assert set(document()["$defs"]) >= kinds


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: m.kind)
def test_real_messages_validate(message):
    obj = _as_json_value(msgpack.unpackb(pack(message), raw=False))
    errors = sorted(e.message for e in _validator().iter_errors(obj))
    assert not errors, errors
    # ... against exactly one definition: the one of its kind
    kind_schema = {"$ref": f"#/$defs/{message.kind}", "$defs": document()["$defs"]}
    assert jsonschema.Draft202012Validator(kind_schema).is_valid(obj)


def test_maps_the_code_refuses_do_not_validate():
    base = _as_json_value(msgpack.unpackb(pack(SAMPLES[10]), raw=False))  # a cancel_reply
    v = _validator()
    assert v.is_valid(base)
    # an unknown key: what a service reads refuses it (strict models); what a client reads allows it (its
    # reader ignores keys it does not know, docs/PROTOCOL.md section 3)
    assert v.is_valid({**base, "surprise": 1})
    request = _as_json_value(msgpack.unpackb(pack(CancelRequest(job_id="j1")), raw=False))
    assert v.is_valid(request) and not v.is_valid({**request, "surprise": 1})
    assert not v.is_valid({**base, "cancelled": "yes"})  # wrong type
    assert not v.is_valid({k: x for k, x in base.items() if k != "job_id"})  # missing field
    assert not v.is_valid({**base, "v": 2})  # another protocol version
    assert not v.is_valid({**base, "kind": "nonsense"})
