"""docs/PROTOCOL.md stays in step with `schemas`: every subject, message kind, field, error
code, dtype and limit the code defines is written down, with the value the code uses."""

from __future__ import annotations

import re
from pathlib import Path

import msgpack
import numpy as np
import pytest

import schemas
from schemas import ErrorCode, StepRequest, limits, messages, pack, subjects
from schemas.tensor import ALLOWED_DTYPES

DOC = (Path(__file__).resolve().parents[1] / "docs" / "PROTOCOL.md").read_text()
HINT = "update docs/PROTOCOL.md to match schemas/"

MESSAGE_TYPES = sorted(
    (obj for obj in vars(messages).values()
     if isinstance(obj, type) and issubclass(obj, messages.Message) and obj is not messages.Message),
    key=lambda c: c.__name__,
)


def _section(kind: str) -> str:
    """The doc text of one message: from its `### \\`kind\\`` heading to the next heading."""
    m = re.search(rf"^### `{re.escape(kind)}`.*?(?=^##)", DOC, flags=re.M | re.S)
    assert m, f"no '### `{kind}`' section: {HINT}"
    return m.group(0)


@pytest.mark.parametrize("cls", MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_every_message_and_field_is_documented(cls):
    kind = cls.model_fields["kind"].default
    text = _section(kind)
    for name in cls.model_fields:
        if name in ("v", "kind"):
            continue
        assert f"`{name}`" in text, f"{cls.__name__}.{name} is not in its section: {HINT}"


def test_every_documented_message_section_exists_in_code():
    kinds = {c.model_fields["kind"].default for c in MESSAGE_TYPES}
    documented = set(re.findall(r"^### `([a-z_]+)`", DOC, flags=re.M))
    assert documented == kinds, HINT


def test_every_error_code_is_documented():
    for code in ErrorCode:
        assert f"| `{code.value}` |" in DOC, f"error code {code.value}: {HINT}"


def test_every_subject_and_queue_group_is_documented():
    for subject in (subjects.JOBS_SUBMIT, subjects.FLEET_STATUS, subjects.ALL_EXPERTS, subjects.ALL_JOB_EVENTS,
                    subjects.ALL_JOB_CANCELS, subjects.ALL_JOB_STATUS):
        assert f"`{subject}`" in DOC, subject
    assert "`" + subjects.job_status("x").replace(".x.", ".<job_id>.") + "`" in DOC
    assert "`" + subjects.expert_velocity(0).replace(".0.", ".<expert_id>.") + "`" in DOC
    assert subjects.expert_queue_group(3).replace(".3.", ".<k>.") in DOC
    assert "`" + subjects.job_events("x").replace(".x.", ".<job_id>.") + "`" in DOC
    assert "`" + subjects.job_cancel("x").replace(".x.", ".<job_id>.") + "`" in DOC
    assert f"ddm.v{schemas.PROTOCOL_VERSION}" in DOC and f"`v: {schemas.PROTOCOL_VERSION}`" in DOC


def test_dtypes_and_limits_match_the_code():
    for dtype in ALLOWED_DTYPES:
        assert f"`{dtype.replace('|', chr(92) + '|')}`" in DOC or f"`{dtype}`" in DOC, dtype
    assert f"{limits.MAX_PAYLOAD_BYTES:,}".replace(",", " ") in DOC  # 8 388 608
    assert f"| rows in one `step_request` | {limits.MAX_STEP_ROWS} |" in DOC
    assert f"| tensor rank | {limits.MAX_TENSOR_NDIM} |" in DOC
    assert f"| {limits.MAX_JOB_IMAGES} |" in DOC and f"| steps in one job | {limits.MAX_JOB_STEPS} |" in DOC
    assert f"1-{limits.MAX_ID_LEN} characters" in DOC
    assert f"{messages.MAX_MESSAGE_LEN} characters" in DOC
    assert schemas.TIME_CONVENTION in DOC


def test_the_documented_example_bytes_are_what_the_codec_sends():
    msg = StepRequest(expert=0, x_t=np.array([1.0, 2.0], np.float32).reshape(1, 1, 1, 2),
                      t=np.array([0.5], np.float32), y=np.array([3], np.int64))
    wire = msgpack.unpackb(pack(msg), raw=False)
    for field in ("x_t", "t", "y"):
        spec = wire[field]
        line = f'"{field}":' + (" " * (4 - len(field))) + f'{{"dtype": "{spec["dtype"]}", "shape": {spec["shape"]}, ' \
               f'"data": h\'{spec["data"].hex().upper()}\'}}'
        assert line in DOC, f"example line for {field} should read: {line}"


def _fault_table() -> str:
    m = re.search(r"^\| fault \| what the client gets \|\n(?:\|.*\n)+", DOC, flags=re.M)
    assert m, f"no per-fault table in section 9: {HINT}"
    return m.group(0)


def test_client_defaults_and_the_frozen_coordinator_are_documented():
    """The per-fault table says what run_job does about a frozen coordinator, with the defaults and
    the reason text the code uses."""
    import inspect

    from coordinator import client

    params = inspect.signature(client.run_job).parameters
    for name in ("probe_every", "lost_after", "unresponsive_after"):
        assert f"`{name}`, default {params[name].default:g} s" in DOC, name
    row = next((line for line in _fault_table().splitlines() if "SIGSTOP" in line), None)
    assert row is not None, f"no row for a frozen (SIGSTOP) coordinator in the per-fault table: {HINT}"
    after = params["unresponsive_after"].default
    assert "`unresponsive_after`" in row and f"default {after:g} s" in row and "`unavailable`" in row, row
    assert f'"the coordinator has not answered for {after:g} s"' in row, row


def test_a_token_that_is_no_job_id_is_documented_as_bad_request():
    for verb in ("cancel", "status"):
        line = next(line for line in DOC.splitlines() if line.startswith(f"| `{subjects.PREFIX}.jobs.<job_id>.{verb}`"))
        assert "`error` / `bad_request` when the token is not a job id" in line, line
