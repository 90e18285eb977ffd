"""Every NATS subject in one place. Versioned: `ddm.v<PROTOCOL_VERSION>.…`.

    ddm.v1.expert.<expert_id>.velocity              expert step requests (request/reply, queue group)
    ddm.v1.expert.<expert_id>.velocity.<worker>     the same, to one worker (request/reply; <worker> = worker_token:
                                                    <16 hex digits>, or <scope>.<16 hex digits> for a scoped worker)
    ddm.v1.c.<client>.jobs.submit                   a client's job submission (request/reply)
    ddm.v1.c.<client>.jobs.<job_id>.events          a job's event stream (accepted/frame/done/failed)
    ddm.v1.c.<client>.jobs.<job_id>.cancel          cancel a job (request/reply or plain publish)
    ddm.v1.c.<client>.jobs.<job_id>.status          what the coordinator knows of a job (request/reply)
    ddm.v1.fleet.status                             coordinator status snapshot (request/reply)
    ddm.v1.decoder.<hash>.decode                    latents -> images (request/reply, queue group; <hash> =
                                                    the autoencoder's content hash, 64 hex digits)

Job subjects live in the submitting client's namespace `ddm.v1.c.<client>.`: the job belongs
to that client, its events go only to its namespace, and a cancel or status request from
another namespace is answered as for an unknown job. On an authenticated bus `<client>` is the
NATS user name and the server's permissions (infra/nats/permissions.conf) confine each user to
its own namespace and to its own reply inbox `_INBOX_<client>.>` (`inbox_prefix(client)`).
Replies go only to reply subjects under `_INBOX` (`is_reply_inbox`).
"""

from __future__ import annotations

import hashlib
import re
from typing import NamedTuple

from .version import PROTOCOL_VERSION

PREFIX = f"ddm.v{PROTOCOL_VERSION}"
#: Root of every client namespace: `ddm.v1.c.<client>.jobs.…`.
CLIENTS_PREFIX = f"{PREFIX}.c"
#: The client token of a caller that names none (open loopback bus, tests, `ddm-fleet up`).
DEFAULT_CLIENT = "anon"

FLEET_STATUS = f"{PREFIX}.fleet.status"

_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # fullmatch: "$" would also match before a final "\n"
_JOB_VERBS = ("events", "cancel", "status")


def _check_token(value: str, what: str) -> str:
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise ValueError(f"{what} {value!r} is not a valid subject token: use 1-64 of [A-Za-z0-9_-]")
    return value


def is_token(value: object) -> bool:
    """True if `value` is a valid subject token (client name, job id, session): 1-64 of [A-Za-z0-9_-]."""
    return isinstance(value, str) and _ID_RE.fullmatch(value) is not None


def check_client(client: str) -> str:
    """`client` itself if it is a valid client token, else ValueError naming the rule."""
    return _check_token(client, "client name")


def expert_velocity(expert_id: int) -> str:
    """Subject an expert's workers serve; requests carry a `StepRequest`."""
    if not isinstance(expert_id, int) or isinstance(expert_id, bool) or expert_id < 0:
        raise ValueError(f"expert id must be a non-negative int, got {expert_id!r}")
    return f"{PREFIX}.expert.{expert_id}.velocity"


#: Hex digits of a worker token (a sha256 prefix of the worker id: 64 bits).
WORKER_TOKEN_HEX = 16
#: A scoped worker's id starts with its scope and this separator: "<scope>:<rest>" (`scoped_worker_id`).
SCOPE_SEP = ":"
_WORKER_TOKEN_RE = re.compile(f"(?:[A-Za-z0-9_-]{{1,64}}\\.)?[0-9a-f]{{{WORKER_TOKEN_HEX}}}")


def scoped_worker_id(scope: str, worker_id: str) -> str:
    """The id of a worker whose direct subject lives under `scope`: "<scope>:<worker_id>". A NATS account
    can then let one host's users subscribe only to `ddm.v1.expert.<K>.velocity.<scope>.*`, so no other
    host receives the requests sent to this host's workers (infra/nats/permissions.conf)."""
    return f"{_check_token(scope, 'direct scope')}{SCOPE_SEP}{worker_id}"


def worker_scope(worker_id: str) -> str | None:
    """The scope a worker id starts with ("<scope>:..."), or None (an unscoped worker)."""
    head, sep, _ = worker_id.partition(SCOPE_SEP)
    return head if sep and is_token(head) else None


def worker_token(worker_id: str) -> str:
    """The subject token(s) of one worker process: the first 16 hex digits of sha256(worker_id), after
    "<scope>." when the id is scoped (`scoped_worker_id`). Worker ids may hold dots or other characters a
    subject token cannot; the token never does."""
    if not isinstance(worker_id, str) or not worker_id:
        raise ValueError(f"worker id must be a non-empty str, got {worker_id!r:.80}")
    token = hashlib.sha256(worker_id.encode("utf-8", "surrogatepass")).hexdigest()[:WORKER_TOKEN_HEX]
    scope = worker_scope(worker_id)
    return token if scope is None else f"{scope}.{token}"


def is_worker_token(value: object) -> bool:
    """True if `value` is a worker token as `worker_token` makes them (16 lowercase hex digits, after
    "<scope>." for a scoped worker)."""
    return isinstance(value, str) and _WORKER_TOKEN_RE.fullmatch(value) is not None


def expert_direct(expert_id: int, token: str) -> str:
    """Subject one worker of expert `expert_id` serves besides the queue group: `token` is its
    `worker_token(worker_id)`. Requests carry a `StepRequest`, replies as on `expert_velocity`."""
    if not is_worker_token(token):
        raise ValueError(
            f"worker token must be {WORKER_TOKEN_HEX} lowercase hex digits, after '<scope>.' for a scoped worker "
            f"(worker_token), got {token!r:.80}"
        )
    return f"{expert_velocity(expert_id)}.{token}"


def expert_queue_group(expert_id: int) -> str:
    """Queue group shared by every worker of one expert (one gets each request)."""
    expert_velocity(expert_id)
    return f"{PREFIX}.expert.{expert_id}.workers"


_HASH_RE = re.compile(r"[0-9a-f]{64}")


def is_content_hash(value: object) -> bool:
    """True if `value` is a content hash as decoder subjects take it (64 lowercase hex digits)."""
    return isinstance(value, str) and _HASH_RE.fullmatch(value) is not None


def decoder_decode(content_hash: str) -> str:
    """Subject the decoders of the autoencoder with `content_hash` (sha256, 64 lowercase hex digits)
    serve; requests carry a `DecodeRequest`. Only the coordinator may publish it (infra/nats)."""
    if not isinstance(content_hash, str) or not _HASH_RE.fullmatch(content_hash):
        raise ValueError(f"decoder hash must be 64 lowercase hex digits (a content hash), got {content_hash!r:.80}")
    return f"{PREFIX}.decoder.{content_hash}.decode"


def decoder_queue_group(content_hash: str) -> str:
    """Queue group shared by every decoder process of one autoencoder (one gets each request)."""
    decoder_decode(content_hash)
    return f"{PREFIX}.decoder.{content_hash}.workers"


def client_namespace(client: str) -> str:
    """`ddm.v1.c.<client>`: the root of one client's job subjects."""
    return f"{CLIENTS_PREFIX}.{check_client(client)}"


def jobs_submit(client: str) -> str:
    """Where `client` submits jobs (a `JobRequest`); the job is owned by `client`."""
    return f"{client_namespace(client)}.jobs.submit"


def _job_subject(client: str, job_id: str, verb: str) -> str:
    return f"{client_namespace(client)}.jobs.{_check_token(job_id, 'job id')}.{verb}"


def job_events(client: str, job_id: str) -> str:
    """Where the coordinator publishes the events of `client`'s job `job_id`."""
    return _job_subject(client, job_id, "events")


def job_cancel(client: str, job_id: str) -> str:
    """Where `client` cancels its job `job_id`."""
    return _job_subject(client, job_id, "cancel")


def job_status(client: str, job_id: str) -> str:
    """Where `client` asks about its job `job_id`."""
    return _job_subject(client, job_id, "status")


#: Wildcards, for permissions and for the coordinator's listeners (every client's namespace).
ALL_EXPERTS = f"{PREFIX}.expert.*.velocity"
ALL_EXPERTS_DIRECT = f"{PREFIX}.expert.*.velocity.*"
ALL_JOBS_SUBMIT = f"{CLIENTS_PREFIX}.*.jobs.submit"
ALL_JOB_EVENTS = f"{CLIENTS_PREFIX}.*.jobs.*.events"
ALL_JOB_CANCELS = f"{CLIENTS_PREFIX}.*.jobs.*.cancel"
ALL_JOB_STATUS = f"{CLIENTS_PREFIX}.*.jobs.*.status"
ALL_DECODERS = f"{PREFIX}.decoder.*.decode"


class JobSubject(NamedTuple):
    """A parsed job subject: `ddm.v1.c.<client>.jobs.<job_id>.<verb>`."""

    client: str
    job_id: str
    verb: str  # "events" | "cancel" | "status"


def _namespace_parts(subject: str) -> list[str] | None:
    """Tokens of a subject under `ddm.v1.c.<client>.jobs.`, with a valid client token; else None."""
    if not isinstance(subject, str):
        return None
    parts = subject.split(".")
    if len(parts) < 6 or f"{parts[0]}.{parts[1]}.{parts[2]}" != CLIENTS_PREFIX or parts[4] != "jobs":
        return None
    return parts if _ID_RE.fullmatch(parts[3]) else None


def parse_submit_subject(subject: str) -> str | None:
    """The client token of `ddm.v1.c.<client>.jobs.submit`, or None if it is not one."""
    parts = _namespace_parts(subject)
    return parts[3] if parts is not None and len(parts) == 6 and parts[5] == "submit" else None


def parse_job_subject(subject: str) -> JobSubject | None:
    """(client, job_id, verb) of `ddm.v1.c.<client>.jobs.<job_id>.events|cancel|status`, or None
    if it is not one (wrong shape, or a client / job id token that is not 1-64 of [A-Za-z0-9_-])."""
    parts = _namespace_parts(subject)
    if parts is None or len(parts) != 7 or parts[6] not in _JOB_VERBS or not _ID_RE.fullmatch(parts[5]):
        return None
    return JobSubject(parts[3], parts[5], parts[6])


def parse_job_namespace(subject: str) -> tuple[str, str] | None:
    """(client token, raw job token) of any `ddm.v1.c.<client>.jobs.<token>.<verb>` subject with a
    valid client token, whether or not `<token>` is a valid job id (for a precise error reply)."""
    parts = _namespace_parts(subject)
    return (parts[3], parts[5]) if parts is not None and len(parts) == 7 else None


#: Reply subjects start with this: `_INBOX.<…>` (nats-py's default) or `_INBOX_<client>.<…>`.
INBOX = "_INBOX"


def inbox_prefix(client: str) -> str:
    """The reply-inbox prefix a connection for `client` uses (nats-py `connect(inbox_prefix=...)`):
    `_INBOX_<client>`; its permissions let it subscribe to `_INBOX_<client>.>` only."""
    return f"{INBOX}_{check_client(client)}"


def inbox_owner(reply: str) -> str | None:
    """The client whose inbox `reply` is (`_INBOX_<client>.…` -> "<client>"); None for `_INBOX.…`
    (an open bus's shared prefix) and anything else."""
    if not is_reply_inbox(reply):
        return None
    head = reply.partition(".")[0]
    return head[len(INBOX) + 1 :] if head != INBOX else None


def is_reply_inbox(reply: str, client: str | None = None) -> bool:
    """True if `reply` is a reply subject we may answer: `_INBOX.<…>` or `_INBOX_<token>.<…>`;
    with `client`, a client-specific inbox must be that client's (`_INBOX_<client>.<…>`)."""
    if not isinstance(reply, str) or not reply.startswith(INBOX) or any(c in reply for c in " \t\r\n*>"):
        return False
    head, dot, rest = reply.partition(".")
    if not dot or not rest or "" in rest.split("."):
        return False
    if head == INBOX:
        return True
    if not head.startswith(INBOX + "_") or not _ID_RE.fullmatch(head[len(INBOX) + 1 :]):
        return False
    return client is None or head == f"{INBOX}_{client}"
