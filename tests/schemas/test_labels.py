"""JobRequest.labels: per-image class labels for any class count; `digits` stays the v1 spelling, and
a job's events name its labels the way its request did, so a v1 client sees exactly what it saw."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from schemas import DoneEvent, JobAccepted, JobRequest, pack, unpack
from schemas.wire import loads


def test_labels_take_any_class_index_and_minus_one():
    req = JobRequest(labels=[0, 57, 999, -1])
    assert req.classes == [0, 57, 999, -1] and req.n_images == 4 and req.n_unconditional == 1
    assert req.label_field == "labels"


def test_digits_keep_their_v1_range_and_wire_form():
    with pytest.raises(ValidationError):
        JobRequest(digits=[10])
    req = JobRequest(digits=[3, 7])
    assert req.classes == [3, 7] and req.label_field == "digits"
    wire = loads(pack(req))
    assert "labels" not in wire and wire["digits"] == [3, 7]  # byte-for-byte the v1 request


@pytest.mark.parametrize("fields", [dict(labels=[1], digits=[1]), dict(labels=[1], count=2), dict()])
def test_exactly_one_way_to_say_how_many(fields):
    with pytest.raises(ValidationError, match="exactly one of labels"):
        JobRequest(**fields)


def test_oracle_refuses_unknown_labels_by_the_field_name_used():
    with pytest.raises(ValidationError, match="1 of 2 labels are -1"):
        JobRequest(labels=[4, -1], strategy="oracle")


def test_events_echo_the_request_field():
    acc = JobAccepted(job_id="j", events_subject="s", labels=[12, 40], seed=1)
    wire = loads(pack(acc))
    assert wire["labels"] == [12, 40] and "digits" not in wire
    assert unpack(pack(acc), JobAccepted).classes == [12, 40]
    old = loads(pack(JobAccepted(job_id="j", events_subject="s", digits=[3], seed=1)))
    assert old["digits"] == [3] and "labels" not in old
    images = np.zeros((2, 3, 8, 8), np.float32)
    done = DoneEvent(
        job_id="j",
        images=images,
        labels=[12, 40],
        usage=np.ones((2, 2), np.float32),
        steps=4,
        strategy="top1",
        elapsed_s=0.1,
    )
    back = unpack(pack(done), DoneEvent)
    assert back.classes == [12, 40] and back.digits is None
    with pytest.raises(ValidationError, match="labels has 1 entries for 2 images"):
        DoneEvent(
            job_id="j",
            images=images,
            labels=[1],
            usage=np.ones((2, 2), np.float32),
            steps=4,
            strategy="top1",
            elapsed_s=0.1,
        )
    with pytest.raises(ValidationError, match="exactly one of labels or digits"):
        JobAccepted(job_id="j", events_subject="s", seed=1)
