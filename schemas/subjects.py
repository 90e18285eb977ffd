"""Every NATS subject in one place. Versioned: `ddm.v<PROTOCOL_VERSION>.…`.

    ddm.v1.expert.<expert_id>.velocity   expert step requests (request/reply, queue group)
    ddm.v1.jobs.submit                   generation job submission (request/reply)
    ddm.v1.jobs.<job_id>.events          a job's event stream (accepted/frame/done/failed)
    ddm.v1.jobs.<job_id>.cancel          cancel a job (request/reply or plain publish)
    ddm.v1.jobs.<job_id>.status          what the coordinator knows of a job (request/reply)
    ddm.v1.fleet.status                  coordinator status snapshot (request/reply)
"""

from __future__ import annotations

import re

from .version import PROTOCOL_VERSION

PREFIX = f"ddm.v{PROTOCOL_VERSION}"

JOBS_SUBMIT = f"{PREFIX}.jobs.submit"
FLEET_STATUS = f"{PREFIX}.fleet.status"

_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # fullmatch: "$" would also match before a final "\n"


def _check_token(value: str, what: str) -> str:
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise ValueError(f"{what} {value!r} is not a valid subject token: use 1-64 of [A-Za-z0-9_-]")
    return value


def expert_velocity(expert_id: int) -> str:
    """Subject an expert's workers serve; requests carry a `StepRequest`."""
    if not isinstance(expert_id, int) or isinstance(expert_id, bool) or expert_id < 0:
        raise ValueError(f"expert id must be a non-negative int, got {expert_id!r}")
    return f"{PREFIX}.expert.{expert_id}.velocity"


def expert_queue_group(expert_id: int) -> str:
    """Queue group shared by every worker of one expert (one gets each request)."""
    expert_velocity(expert_id)
    return f"{PREFIX}.expert.{expert_id}.workers"


def job_events(job_id: str) -> str:
    return f"{PREFIX}.jobs.{_check_token(job_id, 'job id')}.events"


def job_cancel(job_id: str) -> str:
    return f"{PREFIX}.jobs.{_check_token(job_id, 'job id')}.cancel"


def job_status(job_id: str) -> str:
    return f"{PREFIX}.jobs.{_check_token(job_id, 'job id')}.status"


#: Wildcards, for permissions and for the coordinator's cancel listener.
ALL_EXPERTS = f"{PREFIX}.expert.*.velocity"
ALL_JOB_EVENTS = f"{PREFIX}.jobs.*.events"
ALL_JOB_CANCELS = f"{PREFIX}.jobs.*.cancel"
ALL_JOB_STATUS = f"{PREFIX}.jobs.*.status"


def parse_job_subject(subject: str) -> str | None:
    """Job id from `ddm.v1.jobs.<id>.events|cancel|status`, or None if it is not one."""
    parts = subject.split(".")
    if len(parts) == 5 and ".".join(parts[:3]) == f"{PREFIX}.jobs" and _ID_RE.fullmatch(parts[3]):
        return parts[3]
    return None
