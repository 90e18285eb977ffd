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

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "PROTOCOL.md").read_text()
HINT = "update docs/PROTOCOL.md to match schemas/"

MESSAGE_TYPES = sorted(
    (
        obj
        for obj in vars(messages).values()
        if isinstance(obj, type)
        and issubclass(obj, messages.Message)
        and obj is not messages.Message
        and not obj.__name__.startswith("_")
    ),
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
    for subject in (
        subjects.ALL_JOBS_SUBMIT,
        subjects.FLEET_STATUS,
        subjects.ALL_EXPERTS,
        subjects.ALL_JOB_EVENTS,
        subjects.ALL_JOB_CANCELS,
        subjects.ALL_JOB_STATUS,
    ):
        assert f"`{subject}`" in DOC, subject

    def spelled(subject: str) -> str:
        return "`" + subject.replace(".C.", ".<client>.").replace(".x.", ".<job_id>.") + "`"

    assert spelled(subjects.jobs_submit("C")) in DOC
    for make in (subjects.job_events, subjects.job_cancel, subjects.job_status):
        assert spelled(make("C", "x")) in DOC, make
    assert "`" + subjects.expert_velocity(0).replace(".0.", ".<expert_id>.") + "`" in DOC
    assert subjects.expert_queue_group(3).replace(".3.", ".<k>.") in DOC
    assert f"`{subjects.INBOX}.`" in DOC and f"`{subjects.INBOX}_<client>.`" in DOC
    assert f"ddm.v{schemas.PROTOCOL_VERSION}" in DOC and f"`v: {schemas.PROTOCOL_VERSION}`" in DOC


def test_dtypes_and_limits_match_the_code():
    for dtype in ALLOWED_DTYPES:
        assert f"`{dtype.replace('|', chr(92) + '|')}`" in DOC or f"`{dtype}`" in DOC, dtype
    assert f"{limits.MAX_PAYLOAD_BYTES:,}".replace(",", " ") in DOC  # 8 388 608
    assert f"| rows in one `step_request` | {limits.MAX_STEP_ROWS} |" in DOC
    assert f"| tensor rank | {limits.MAX_TENSOR_NDIM} |" in DOC
    assert f"| {limits.MAX_JOB_IMAGES} |" in DOC and f"| steps in one job | {limits.MAX_JOB_STEPS} |" in DOC
    assert f"| 0 to {limits.MAX_GUIDANCE_SCALE:g} | `bad_request` |" in DOC
    assert f"1-{limits.MAX_ID_LEN} characters" in DOC
    assert f"{messages.MAX_MESSAGE_LEN} characters" in DOC
    assert schemas.TIME_CONVENTION in DOC


def test_the_documented_example_bytes_are_what_the_codec_sends():
    msg = StepRequest(
        expert=0,
        x_t=np.array([1.0, 2.0], np.float32).reshape(1, 1, 1, 2),
        t=np.array([0.5], np.float32),
        y=np.array([3], np.int64),
    )
    wire = msgpack.unpackb(pack(msg), raw=False)
    for field in ("x_t", "t", "y"):
        spec = wire[field]
        line = (
            f'"{field}":' + (" " * (4 - len(field))) + f'{{"dtype": "{spec["dtype"]}", "shape": {spec["shape"]}, '
            f"\"data\": h'{spec['data'].hex().upper()}'}}"
        )
        assert line in DOC, f"example line for {field} should read: {line}"


def _fault_table() -> str:
    m = re.search(r"^\| fault \| what the client gets \|\n(?:\|.*\n)+", DOC, flags=re.M)
    assert m, f"no per-fault table in section 9: {HINT}"
    return m.group(0)


def test_client_defaults_and_the_frozen_coordinator_are_documented():
    """The per-fault table says what run_job does about a frozen coordinator, with the defaults and
    the reason text the code uses."""
    import inspect

    from client import jobs as client

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
        line = next(
            line
            for line in DOC.splitlines()
            if line.startswith(f"| `{subjects.CLIENTS_PREFIX}.<client>.jobs.<job_id>.{verb}`")
        )
        assert "`error` / `bad_request` when the token is not a job id" in line, line


# ------------------------------------------------------------------ statements an independent client relies on
# (each found missing or wrong by one; the behaviour itself is tested over a real nats-server in
# tests/coordinator/test_protocol_replies.py)

FLAT = " ".join(DOC.split())  # the doc with its line breaks folded, for phrases that wrap


def test_a_submit_is_answered_accepted_or_rejected_never_error():
    row = next(
        line for line in DOC.splitlines() if line.startswith(f"| `{subjects.CLIENTS_PREFIX}.<client>.jobs.submit`")
    )
    assert "`accepted` or `rejected` (never `error`" in row, row
    assert "* submit reply: `accepted` | `rejected` (the coordinator never sends `error`" in DOC
    assert "reply: accepted | rejected ─" in DOC and "accepted | rejected | error" not in DOC
    import inspect

    from coordinator.intake import Intake

    src = inspect.getsource(Intake._on_submit)  # every refusal goes through _refused or JobRejected directly
    assert "ErrorReply" not in src and src.count("_refused(") + src.count("JobRejected(") >= 4
    assert "ErrorReply" not in inspect.getsource(Intake._refused)


def test_queue_position_is_documented_as_the_scheduler_counts_it():
    from coordinator.scheduler import Scheduler, SchedulerConfig

    sched = Scheduler(SchedulerConfig(num_experts=1, max_rows=1))
    positions = [sched.submit(messages.JobRequest(digits=[1], seed=i), now=0.0).queue_position for i in range(3)]
    assert positions == [0, 1, 2]  # runs at once; next to start; one job ahead
    assert "0: the job runs at once" in FLAT and "n ≥ 1: it waits in the queue, n-th to start (n − 1 jobs ahead" in FLAT
    assert "`queued`: place in the queue, 1 = next to start (n − 1 jobs ahead)" in FLAT


def test_rejected_and_submitted_counters_say_what_they_count():
    assert "| `jobs_submitted` | int | submits answered `accepted`" in DOC
    assert "| `jobs_rejected` | int | submits answered `rejected`, since start, whatever the reason" in DOC
    assert "Each one counts in `fleet_status.jobs_rejected`" in FLAT


def test_the_documented_decode_error_text_is_the_codecs():
    with pytest.raises(schemas.ProtocolError) as err:
        schemas.unpack(b"\xc1", messages.JobRequest)
    assert f"`{err.value.message}`" in FLAT, err.value.message


def test_frame_versus_done_bound_is_float16_rounding():
    """The doc's 2^-12: the largest float16 rounding error of a value in [-1, 1]."""
    x = np.linspace(-1, 1, 200_001, dtype=np.float32)
    assert np.abs(x.astype(np.float16).astype(np.float32) - x).max() <= 2.0**-12
    assert np.abs(x.astype(np.float16).astype(np.float32) - x).max() > 2.0**-13
    assert "at most 2^-12 (0.000244)" in FLAT and "clip(last frame `x`, −1, 1) equals `images` within 2^-12" in FLAT
    assert "**not** clipped to [−1, 1]" in DOC


def test_usage_counts_any_positive_weight_as_documented():
    from coordinator import strategies

    w = strategies.full(np.array([[1e-9, 1 - 1e-9]]), np.array([True, True]))
    assert (w > 0).all()  # the near-zero expert is called and counts
    assert "is above 0, however small: with `full` a router that gives an expert 1e-9 still calls it" in FLAT
    assert "velocity evaluations (`steps` for euler, 2 × `steps` for heun)" in FLAT


def test_padding_value_is_documented():
    from dataset.mnist import to_model_range

    img = to_model_range(np.full((1, 28, 28), 255, np.uint8))
    assert img.shape == (1, 1, 32, 32) and img[0, 0, 2:30, 2:30].min() == 1.0
    border = np.ones((32, 32), bool)
    border[2:30, 2:30] = False
    assert (img[0, 0][border] == -1.0).all()
    assert to_model_range(np.zeros((1, 28, 28), np.uint8)).max() == -1.0
    assert "padded to 32×32 by 2 pixels on each side with **−1** (background, not 0)" in FLAT


def test_srv_replies_are_documented_as_json_and_cancel_mismatch_as_refused():
    assert "The replies on `$SRV.*` are **JSON**" in FLAT
    assert "`cancelled: false`" in DOC and "`body job_id 'x' does not match the subject`" in FLAT
    import inspect

    from coordinator.intake import Intake

    assert "does not match the subject" in inspect.getsource(Intake.on_cancel)


def test_ownership_reason_and_reply_rule_are_documented_as_the_coordinator_answers():
    from coordinator.service import UNKNOWN_JOB

    assert f"reason `{UNKNOWN_JOB}`" in FLAT and f"hold in the requester's namespace: `{UNKNOWN_JOB}`" in FLAT
    assert "gets no reply at all" in FLAT and 'inbox_prefix="_INBOX_alice"' in FLAT
    assert "`<client>/<session>`" in FLAT


# ------------------------------------------------------------------ service metadata ($SRV.INFO), section 2.2


def _metadata_table(title: str) -> dict[str, str]:
    """{key: format} of the section 2.2 table that follows the line starting with `title`."""
    section = re.search(r"^### 2\.2 .*?(?=^## )", DOC, flags=re.M | re.S)
    assert section, f"no section 2.2 (service metadata): {HINT}"
    m = re.search(
        rf"^{re.escape(title)}.*?\n\n(\| key \| format \| meaning \|\n(?:\|.*\n)+)", section.group(0), re.M | re.S
    )
    assert m, f"no metadata table after {title!r} in section 2.2: {HINT}"
    rows = re.findall(r"^\| `([a-z_]+)` \| ([^|]+) \|", m.group(1), flags=re.M)
    return {key: fmt.strip() for key, fmt in rows}


def _method_source(path: str, cls: str, method: str) -> str:
    """The source of `cls.method` in the file `path`, read without importing it (the xla backend's module
    names torch_neuronx, which the test extra does not provide)."""
    import ast

    text = (ROOT / path).read_text()
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    return ast.get_source_segment(text, item) or ""
    raise AssertionError(f"{path} has no {cls}.{method}")


def _source_keys(*functions) -> set[str]:
    """The metadata keys a function's source sets (a function, or its source text): dict literal keys,
    `x["key"] =` and `update(key=...)`."""
    import inspect

    keys: set[str] = set()
    for fn in functions:
        src = fn if isinstance(fn, str) else inspect.getsource(fn)
        keys |= set(re.findall(r'"([a-z_]+)": ', src))
        keys |= set(re.findall(r'\b[a-z]+\["([a-z_]+)"\] = ', src))
        for call in re.findall(r"\.update\(([^)]*)\)", src):
            keys |= set(re.findall(r"\b([a-z_]+)=", call))
    return keys


def test_every_metadata_key_a_worker_or_decoder_publishes_is_documented_as_a_string():
    """Each key the expert workers (every backend) and the decoders put in their service metadata has a
    row in section 2.2, with a string format; the rule that every value is a string is stated."""
    from workers.advertise import worker_metadata
    from workers.backends import base, sim_backend, torch_backend
    from workers.decoder_service import DecoderWorker

    assert "**every value is a JSON string**" in FLAT and '`"run_ahead": "16"`' in FLAT
    assert "a number, 16 today" not in FLAT  # run_ahead is a string, not a number
    formats = {"decimal integer", "decimal integers, comma-separated", "shape", "range", '`"true"`'}
    formats |= {'`"true"` / `"false"`', "text", "JSON", 'decimal integer, or `""`'}
    expert = _metadata_table("Expert workers (`$SRV.INFO.ddm-expert`)")
    published = _source_keys(
        worker_metadata,
        base.BackendBase.describe,
        torch_backend.TorchBackend.describe,
        _method_source("workers/backends/xla_backend.py", "XlaBackend", "describe"),
        sim_backend.SimBackend.describe,
    )
    assert {"expert", "run_ahead", "guidance", "spec", "dtype", "compiled", "neuron", "sim"} <= published
    assert published - set(expert) == set(), f"expert worker metadata keys not in section 2.2: {HINT}"
    assert set(expert.values()) <= formats, expert
    assert expert["run_ahead"] == "decimal integer" and expert["spec"] == "JSON"
    decoder = _metadata_table("Decoders (`$SRV.INFO.ddm-decoder`")
    published = _source_keys(DecoderWorker.metadata)
    assert {"decoder", "image_shape", "image_value_range", "max_request_rows", "protocol"} <= published
    assert published - set(decoder) == set(), f"decoder metadata keys not in section 2.2: {HINT}"
    assert set(decoder.values()) <= formats, decoder
    assert decoder["image_shape"] == "shape" and decoder["image_value_range"] == "range"


async def test_the_metadata_on_the_bus_is_strings_and_documented(nats_url, nc, tmp_path):
    """What a real worker and a real decoder answer on `$SRV.INFO`: every metadata value (service and
    endpoints) a JSON string, every key documented in section 2.2, and the formats hold."""
    import json

    from bus.gather import gather_replies
    from models.tiny import make_tiny_autoencoder, make_tiny_expert
    from workers.decoder_service import DecoderWorker
    from workers.service import ExpertWorker

    expert = make_tiny_expert(tmp_path / "e0", expert_id=0)
    ae = make_tiny_autoencoder(tmp_path / "ae")
    async with ExpertWorker(0, str(expert), "torch", nats_url=nats_url, buckets=(1,)):
        async with DecoderWorker(ae, nats_url=nats_url):
            infos = {
                name: [json.loads(r) for r in await gather_replies(nc, f"$SRV.INFO.{name}", window=0.5)]
                for name in ("ddm-expert", "ddm-decoder")
            }
    tables = {
        "ddm-expert": _metadata_table("Expert workers (`$SRV.INFO.ddm-expert`)"),
        "ddm-decoder": _metadata_table("Decoders (`$SRV.INFO.ddm-decoder`"),
    }
    patterns = {
        "decimal integer": r"[0-9]+",
        "decimal integers, comma-separated": r"[0-9]+(,[0-9]+)*",
        "shape": r"[0-9]+,[0-9]+,[0-9]+",
        "range": r"[-+0-9.eE]+,[-+0-9.eE]+",
        '`"true"`': r"true",
        '`"true"` / `"false"`': r"true|false",
        'decimal integer, or `""`': r"[0-9]*",
    }
    for name, found in infos.items():
        assert len(found) == 1, name
        info = found[0]
        for key, value in info["metadata"].items():
            assert isinstance(value, str), (name, key, value)
            fmt = tables[name].get(key)
            assert fmt is not None, f"{name} metadata key {key!r} is not in section 2.2: {HINT}"
            if fmt in patterns:
                assert re.fullmatch(patterns[fmt], value), (name, key, value, fmt)
            if fmt == "JSON":
                json.loads(value)
        for endpoint in info["endpoints"]:
            for key, value in (endpoint.get("metadata") or {}).items():
                assert isinstance(value, str) and f"`{key}`" in FLAT, (name, endpoint["name"], key)


# ------------------------------------------------------------------ what a client had to guess (fleet spec, replies)


def test_the_image_fields_and_how_to_ask_for_them_are_documented():
    """The reported spec's image fields, the request that asks for them (as the coordinator reads it: no `v`
    / `kind` needed, other keys ignored) and what each tensor carries per space are written down."""
    import json

    from coordinator.intake import status_options
    from schemas.spec import IMAGE_FIELDS

    section = _section("fleet_status")
    for name in IMAGE_FIELDS:
        assert f"`{name}`" in section, f"fleet spec field {name} is not in the fleet_status section: {HINT}"
    assert '`"image_spec": true`' in section and "msgpack `81 A4 73 70 65 63 C3`" in section
    assert msgpack.packb({"spec": True}) == bytes.fromhex("81A473706563C3")
    assert "it needs no `v` or `kind`" in " ".join(section.split())
    for body in ({"spec": True}, {"v": 1, "kind": "fleet_status_request", "spec": True, "other": 3}):
        assert status_options(msgpack.packb(body)) == status_options(json.dumps(body).encode()) == (True, False)
    assert status_options(msgpack.packb({"spec": True, "image_spec": True})) == (True, True)
    assert status_options(msgpack.packb({"image_spec": True})) == status_options(b"") == (False, False)
    assert status_options(b"\x81\xa4spec\xc3" + b" " * 1024) == (False, False)  # over 1024 bytes: a plain request
    table = re.search(
        r"^\| what \| pixel fleet \(`space: pixels`\) \| latent fleet \(`space: latent`\) \|\n(?:\|.*\n)+", DOC, re.M
    )
    assert table, f"no per-space table of what the spec describes: {HINT}"
    rows = {line.split("|")[1].strip(): line for line in table.group(0).splitlines()[2:]}
    assert set(rows) >= {
        "`sample_shape`, `value_range`",
        "`image_shape`, `image_value_range`",
        "`frame.x`, `frame.x1`",
        "`frame.preview`",
        "`done.images`",
        "`done.latents`",
    }
    assert "**latents**" in rows["`sample_shape`, `value_range`"]
    assert "equal to `sample_shape`, `value_range`" in rows["`image_shape`, `image_value_range`"]
    assert "N × `image_shape`" in rows["`done.images`"] and "N × `sample_shape`" in rows["`frame.x`, `frame.x1`"]
    assert "N × the spec's `image_shape`" in _section("done") and "N × the spec's `image_shape`" in _section("frame")


def test_frames_travel_in_float16_as_documented():
    import inspect

    from coordinator import decode_stage, scheduler

    assert "| `x` | tensor | yes | `<f2` (float16) always" in DOC
    assert "`<f2` is IEEE 754 binary16, little-endian" in FLAT
    src = inspect.getsource(scheduler)
    assert "x=euler.frame16[rows] if euler is not None else frame_float16(g.x)" in src
    assert "frame_float16(g.x + (1.0 - g.t) * g.last_u)" in src
    assert "astype(np.float16)" in inspect.getsource(decode_stage.with_preview)


def test_arch_is_documented_as_the_coordinator_fills_it():
    from coordinator.local_fleet import LabelRouter
    from coordinator.service import DEFAULT_ROUTER_ARCH, router_arch
    from models.router import Router

    assert Router.arch == DEFAULT_ROUTER_ARCH == "router" and LabelRouter.arch == "label"
    assert router_arch(object()) == "router"
    assert "**`arch`** names what routes the fleet's images to its experts, by one rule for every fleet" in FLAT
    assert "`router` for a trained router" in FLAT and "`label` for the class-table stand-in" in FLAT
    assert "(the router's network)" not in FLAT


def test_status_and_cancel_error_replies_are_documented_with_the_codes_the_coordinator_sends():
    import inspect

    from coordinator.intake import Intake

    table = re.search(r"^\| request \| code \| when \|\n(?:\|.*\n)+", DOC, re.M)
    assert table, f"no table of the error replies of status and cancel requests: {HINT}"
    documented = {
        (row.split("|")[1].strip(), row.split("|")[2].strip().strip("`")) for row in table.group(0).splitlines()[2:]
    }
    status_codes = set(re.findall(r"ErrorCode\.([A-Z_]+)", inspect.getsource(Intake.on_job_status)))
    status_codes |= set(re.findall(r"ErrorCode\.([A-Z_]+)", inspect.getsource(Intake._not_a_job_id)))
    cancel_codes = set(re.findall(r"ErrorCode\.([A-Z_]+)", inspect.getsource(Intake.on_cancel)))
    cancel_codes |= set(re.findall(r"ErrorCode\.([A-Z_]+)", inspect.getsource(Intake._not_a_job_id)))
    expected = {("job status", ErrorCode[c].value) for c in status_codes}
    expected |= {("cancel", ErrorCode[c].value) for c in cancel_codes}
    assert documented == expected, f"{documented} != {expected}: {HINT}"
    assert '`{"v": 1, "kind": "error", "code": …, "message": …, "request_id": nil}`' in FLAT
    wire = msgpack.unpackb(pack(messages.ErrorReply(code=ErrorCode.BAD_REQUEST, message="m")), raw=False)
    assert list(wire) == ["v", "kind", "code", "message", "request_id"] and wire["request_id"] is None
    assert "* job status reply: `job_status` | `error`" in DOC and "* cancel reply: `cancel_reply` | `error`" in DOC


def test_the_republish_limit_counts_only_copies_as_documented():
    import inspect

    from coordinator import intake

    src = inspect.getsource(intake)
    assert src.count("self._republished_at[") == 1  # set in _may_republish only: the original event is not a copy
    assert "self._republished_at[(client, job_id)] = now" in inspect.getsource(intake.Intake._may_republish)
    assert f"at most once every {intake.REPUBLISH_EVERY_S:g} s per job, counted from the last copy" in FLAT
    assert "the original terminal event does not count" in FLAT


def test_clients_ignore_unknown_keys_and_seeds_are_64_bit_as_documented():
    from coordinator.scheduler import Scheduler

    assert "**A client does the opposite with what it receives: it ignores a key it does not know**" in FLAT
    seed = messages.JobRequest.model_fields["seed"].metadata
    assert any(getattr(m, "lt", None) == 2**63 for m in seed) and any(getattr(m, "ge", None) == 0 for m in seed)
    from coordinator.scheduler import SchedulerConfig

    sched = Scheduler(SchedulerConfig(num_experts=1, max_rows=1))
    drawn = [sched.submit(messages.JobRequest(digits=[1]), now=0.0).seed for _ in range(20)]
    assert all(0 <= s < 2**63 for s in drawn) and max(drawn) > 2**53  # drawn seeds: [0, 2^63), mostly above 2^53
    assert msgpack.packb(2**53)[0] == 0xCF  # a drawn seed arrives as a uint 64
    assert "the coordinator draws one uniformly from [0, 2^63)" in FLAT and "`useBigInt64: true`" in FLAT
    assert "| `seed` | int | yes | 0 ≤ seed < 2^63 |" in DOC


def test_preview_every_not_a_multiple_of_frame_every_is_documented_as_it_behaves():
    from coordinator.decode_stage import LatentOptions, wants_preview
    from schemas import FrameEvent

    def frame(step: int) -> FrameEvent:
        return FrameEvent(
            job_id="j",
            step=step,
            steps=13,
            t=step / 13,
            x=np.zeros((1, 1, 1, 1), np.float16),
            experts=[0],
            weights=np.ones((1, 1), np.float32),
        )

    frame_steps = [s for s in range(1, 14) if s % 2 == 0 or s == 13]  # frame_every 2: what the scheduler sends
    previews = [s for s in frame_steps if wants_preview(LatentOptions(preview_every=3), frame(s))]
    assert previews == [6, 12, 13]
    assert "any other value is accepted without a word" in FLAT
    assert "`frame_every` 2 and `preview_every` 3: steps 6, 12, …) and on the last frame" in FLAT


def test_defaults_are_given_as_values():
    from coordinator.config import CoordinatorConfig

    cfg = CoordinatorConfig()
    bound = (cfg.retries + 1) * (cfg.step_timeout + 0.5)
    assert f"({bound:g} s\nwith the defaults, {cfg.retries} retries and {cfg.step_timeout:g} s)" in DOC
    assert f"`--max-job-cost`, {cfg.max_job_cost} row evaluations by default" in DOC
    assert f"`--run-ahead`, {cfg.run_ahead} steps by default" in DOC
    assert f"`--run-ahead-rows` rows, {cfg.run_ahead_rows} by default" in DOC
