"""schemas.subjects: the client-namespace job subjects, their parsers and the reply-inbox rule."""

from __future__ import annotations

import msgpack
import pytest

from schemas import JobRequest, ProtocolError, pack, subjects, unpack


def test_job_subjects_live_in_the_clients_namespace_and_parse_back():
    assert subjects.jobs_submit("alice") == "ddm.v1.c.alice.jobs.submit"
    for verb, make in (
        ("events", subjects.job_events),
        ("cancel", subjects.job_cancel),
        ("status", subjects.job_status),
    ):
        subject = make("alice", "j-1")
        assert subject == f"ddm.v1.c.alice.jobs.j-1.{verb}"
        assert subjects.parse_job_subject(subject) == ("alice", "j-1", verb)
        assert subjects.parse_submit_subject(subject) is None
    assert subjects.parse_submit_subject(subjects.jobs_submit("web")) == "web"
    assert subjects.parse_job_subject(subjects.jobs_submit("web")) is None
    # the old un-namespaced subjects are gone: nothing parses them, nothing builds them
    for old in ("ddm.v1.jobs.submit", "ddm.v1.jobs.j1.cancel", "ddm.v1.jobs.j1.events"):
        assert subjects.parse_job_subject(old) is None and subjects.parse_submit_subject(old) is None
    assert not hasattr(subjects, "JOBS_SUBMIT")


def test_parsers_refuse_wrong_shapes_and_bad_tokens():
    for subject in (
        "ddm.v1.c.alice.jobs.j1.delete",
        "ddm.v1.c.alice.jobs.j1.cancel.x",
        "ddm.v2.c.a.jobs.j1.cancel",
        "ddm.v1.x.alice.jobs.j1.cancel",
        "ddm.v1.c.alice.job.j1.cancel",
        "ddm.v1.c.a%b.jobs.j1.cancel",
        "ddm.v1.c.alice.jobs.j%1.status",
        "",
        None,
    ):
        assert subjects.parse_job_subject(subject) is None, subject
    assert subjects.parse_job_namespace("ddm.v1.c.alice.jobs.j%1.status") == ("alice", "j%1")
    assert subjects.parse_job_namespace("ddm.v1.c.a%b.jobs.j1.status") is None
    assert subjects.parse_submit_subject("ddm.v1.c.a%b.jobs.submit") is None


def test_wildcards_match_exactly_the_built_subjects():
    def matches(pattern: str, subject: str) -> bool:
        p, s = pattern.split("."), subject.split(".")
        return len(p) == len(s) and all(a in ("*", b) for a, b in zip(p, s))

    assert matches(subjects.ALL_JOBS_SUBMIT, subjects.jobs_submit("x"))
    assert matches(subjects.ALL_JOB_EVENTS, subjects.job_events("x", "j"))
    assert matches(subjects.ALL_JOB_CANCELS, subjects.job_cancel("x", "j"))
    assert matches(subjects.ALL_JOB_STATUS, subjects.job_status("x", "j"))
    assert not matches(subjects.ALL_JOB_CANCELS, subjects.job_status("x", "j"))


@pytest.mark.parametrize(
    "reply, client, ok",
    [
        ("_INBOX.abc.1", None, True),
        ("_INBOX.abc.1", "alice", True),  # nats-py's default inbox: fine for anyone
        ("_INBOX_alice.abc.1", None, True),
        ("_INBOX_alice.abc.1", "alice", True),
        ("_INBOX_alice.abc.1", "bob", False),  # a request in bob's namespace answered into alice's inbox
        ("ddm.v1.c.bob.jobs.j1.events", None, False),
        ("_INBOXES.x", None, False),
        ("_INBOX_.x", None, False),
        ("_INBOX", None, False),
        ("_INBOX.", None, False),
        ("_INBOX.a..b", None, False),
        ("_INBOX.>", None, False),
        ("_INBOX.a b", None, False),
        ("", None, False),
        (None, None, False),
    ],
)
def test_replies_go_only_to_inboxes(reply, client, ok):
    assert subjects.is_reply_inbox(reply, client) is ok


def test_inbox_prefix_and_client_names():
    assert subjects.inbox_prefix("web") == "_INBOX_web"
    assert subjects.is_reply_inbox(subjects.inbox_prefix("web") + ".nuid.1", "web")
    for bad in ("", "a.b", "a b", "x" * 65, "é", "a>", "a*"):
        with pytest.raises(ValueError, match="1-64 of"):
            subjects.check_client(bad)


def test_job_request_session_is_an_optional_token():
    assert unpack(pack(JobRequest(digits=[1], session="tab_1-A")), JobRequest).session == "tab_1-A"
    assert JobRequest(digits=[1]).session is None
    for bad in ("", "a b", "x" * 65, "a.b", "tab\n"):
        wire = msgpack.unpackb(pack(JobRequest(digits=[1])), raw=False)
        wire["session"] = bad
        with pytest.raises(ProtocolError) as err:
            unpack(msgpack.packb(wire, use_bin_type=True), JobRequest)
        assert err.value.code.value == "bad_request" and "session" in err.value.message, err.value.message
