"""One browser tab = one websocket = one `Session`.

A session owns the jobs its socket submitted (and only those): it picks each job id,
subscribes to the job's event subject *before* submitting, forwards the events to its socket,
and cancels every unfinished job when the socket closes. Other tabs never see its jobs.
A job that has sent nothing for `probe_every` seconds is asked about (`client.jobs.JobProbe`):
if the coordinator lost it (restarted, or gone for `lost_after` s) or has answered nothing for
`unresponsive_after` s (frozen), the page gets `failed` / `unavailable` with the reason instead of
waiting forever.

Outgoing messages go through an `Outbox`: control messages (accepted, done, errors, ...)
are kept in order and never dropped; frames are coalesced per job, so a slow browser
skips intermediate frames instead of piling them up in memory; pongs coalesce too (a page that
pings faster than it reads gets the latest one). At most `max_queued` control messages wait: a
client that lets more pile up is not reading, and its socket is closed (1008, with the reason).

A job this tab gave up on is cancelled, never left running for nobody: the socket closed, the
page cancelled it, its submit timed out (the coordinator may still have accepted it), or its
probe declared it lost.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from bus.inbox import private_request
from client.done_parts import MAX_RESULT_ASKS, REPUBLISH_GAP_S, DoneParts
from client.epochs import EpochFilter
from client.jobs import JobProbe, client_of, job_status, probe_timeout, publish_cancel, unsubscribe_quietly
from schemas import (
    MAX_JOB_STEPS,
    DoneEvent,
    DonePartEvent,
    ErrorCode,
    FailedEvent,
    FrameEvent,
    JobAccepted,
    JobEvent,
    JobRejected,
    ProtocolError,
    SubmitReply,
    pack,
    subjects,
    unpack,
)
from schemas.spec import ModelSpec

from .frames import event_message
from .protocol import MNIST_SPEC, BadInput, Cancel, Generate, Ping, parse_client_message

log = logging.getLogger(__name__)

#: Unfinished jobs one tab may have at a time.
MAX_JOBS_PER_SOCKET = 8
#: Control messages (not frames, not the fleet snapshot, not pongs) that may wait for a socket.
MAX_QUEUED_MESSAGES = 256
#: Websocket close code for a client that does not read (policy violation).
CLOSE_NOT_READING = 1008
#: The client token of a viewer whose NATS connection names none (an open bus).
WEB_CLIENT = "web"
#: On a latent fleet, a job asks for decoded preview frames every this many steps (`WebConfig.preview_every`).
DEFAULT_PREVIEW_EVERY = 4


def preview_interval(every: int, frame_every: int) -> int:
    """The `preview_every` of a job: `every` rounded up to a multiple of its `frame_every` (previews ride on
    frames, which exist only every `frame_every` steps), at most MAX_JOB_STEPS."""
    fe = max(1, int(frame_every))
    n = -(-max(1, int(every)) // fe) * fe
    return n if n <= MAX_JOB_STEPS else fe * (MAX_JOB_STEPS // fe)


_MISSING = object()


def preview_key(job_id: str) -> str:
    """The outbox slot of a job's latest frame that carries a decoded preview (latent fleets): coalesced
    apart from its other frames, so frames without a preview never supersede the last one with."""
    return job_id + "/preview"


class Outbox:
    """Ordered outgoing queue with per-job frame coalescing.

    `put(msg)` enqueues a message; `put_latest(key, item)` replaces any item under the same key
    that has not been sent yet (keeping the queue position of the first one): a job's frames,
    the fleet snapshot. `drop(key)` forgets a pending item (a job that finished). `get()` waits
    for the next item; latest-items come back as whatever `item` was (rendered lazily).
    At most `max_messages` `put` messages wait: one more closes the outbox (pending items are
    dropped, `overflowed` is set) and calls `on_overflow()`.
    """

    def __init__(self, max_messages: int = MAX_QUEUED_MESSAGES, on_overflow: Callable[[], None] | None = None) -> None:
        if max_messages < 1:
            raise ValueError(f"max_messages must be >= 1, got {max_messages}")
        self._queue: deque[tuple[str, Any]] = deque()
        self._frames: dict[str, Any] = {}
        self._ready = asyncio.Event()
        self.closed = False
        self.max_messages = max_messages
        self.on_overflow = on_overflow
        self.overflowed = False
        self.queued_messages = 0  # "msg" items waiting

    def __len__(self) -> int:
        """Items waiting (messages + latest-slots): what this socket holds in memory."""
        return len(self._queue)

    def put(self, msg: dict[str, Any]) -> None:
        if self.closed:
            return
        if self.queued_messages >= self.max_messages:
            self.overflowed = True
            self.close()
            self._queue.clear()
            self._frames.clear()
            self.queued_messages = 0
            if self.on_overflow is not None:
                self.on_overflow()
            return
        self._queue.append(("msg", msg))
        self.queued_messages += 1
        self._ready.set()

    def put_latest(self, key: str, item: Any) -> None:
        if self.closed:
            return
        if key not in self._frames:
            self._queue.append(("latest", key))
        self._frames[key] = item
        self._ready.set()

    def drop(self, key: str) -> None:
        """Forget the pending item under `key`, and its place in the queue: a later `put_latest(key)` queues
        it again at the end (never ahead of what was queued meanwhile)."""
        if self._frames.pop(key, _MISSING) is not _MISSING:
            try:
                self._queue.remove(("latest", key))
            except ValueError:
                pass

    def close(self) -> None:
        self.closed = True
        self._ready.set()

    async def get(self) -> tuple[str, Any] | None:
        """Next ("msg", dict) or ("latest", item); None once closed."""
        while True:
            while self._queue:
                kind, value = self._queue.popleft()
                if kind == "latest":
                    if value not in self._frames:
                        continue  # dropped: e.g. the job ended before its frame went out
                    return "latest", self._frames.pop(value)
                self.queued_messages -= 1
                return kind, value
            if self.closed:
                return None
            self._ready.clear()
            await self._ready.wait()


@dataclass
class _Job:
    """One unfinished job of a socket. Events that arrive before the job was announced to the
    page (the coordinator may stream before its submit reply is read) wait in `early`."""

    ref: Any = None
    sub: Any = None
    announced: bool = False
    early: list = field(default_factory=list)
    last_event: float = field(default_factory=time.monotonic)
    probe: Any = None  # JobProbe, once announced
    epochs: EpochFilter = field(default_factory=EpochFilter)  # owner epochs: stale events are dropped
    parts: DoneParts = field(default_factory=DoneParts)  # a result too large for one message, in parts


#: Keys the user -> session tag hash: fixed per process, so a user's tag is the same on each of its sockets
#: and nobody can tell from a tag which address it stands for.
_TAG_KEY = secrets.token_bytes(16)


def user_session_tag(user: str) -> str:
    """The session tag of a viewer user's jobs ("u" + 16 hex digits, a keyed hash of `user`)."""
    import hashlib

    return "u" + hashlib.blake2b(user.encode(), key=_TAG_KEY, digest_size=8).hexdigest()


class Session:
    """Job bookkeeping for one socket. `send` writes one JSON message to the socket.

    Call `handle(text)` for each text frame, `run_sender()` as a task, `close()` at the end.
    The page always gets `accepted` before any frame of that job, and nothing after its
    `done` / `failed` / `cancelled`.
    """

    def __init__(
        self,
        nc,
        send: Callable[[dict[str, Any]], Awaitable[None]],
        *,
        submit_timeout: float = 5.0,
        max_jobs: int = MAX_JOBS_PER_SOCKET,
        probe_every: float = 3.0,
        lost_after: float = 15.0,
        unresponsive_after: float | None = 60.0,
        max_queued: int = MAX_QUEUED_MESSAGES,
        close_socket: Callable[[int, str], Awaitable[None]] | None = None,
        spec: Callable[[], ModelSpec] | None = None,
        preview_every: int = DEFAULT_PREVIEW_EVERY,
        user: str = "",
        user_jobs: Callable[[], int] | None = None,
        max_user_jobs: int | None = None,
    ):
        """user: who the socket's requests count against (web.guard.client_key: the browser's address, or
        its X-Forwarded-For hop behind trusted proxies); its jobs carry a session tag derived from it (a
        keyed hash: the same on every socket of that user, told to nobody), so the coordinator shares
        rows fairly between users, not sockets. user_jobs(): that user's unfinished jobs over all its
        sockets; with max_user_jobs, a generate past it is refused `overloaded`.
        close_socket(code, reason): closes this session's socket (called when the client does not read).
        spec(): the fleet's current model spec (labels are read against it, images mapped from its value
        range); None: the MNIST fleet's. preview_every: on a latent fleet, every job asks for decoded preview
        frames this often (in steps; rounded up to a multiple of the job's frame_every)."""
        if not 1 <= preview_every <= MAX_JOB_STEPS:
            raise ValueError(f"preview_every must be 1-{MAX_JOB_STEPS}, got {preview_every!r}")
        self.preview_every = preview_every
        self.nc = nc
        self._spec = spec
        self._send = send
        self._close_socket = close_socket
        self._closer: asyncio.Future | None = None
        self.submit_timeout = submit_timeout
        self.max_jobs = max_jobs
        self.probe_every = probe_every
        self.lost_after = lost_after
        self.unresponsive_after = unresponsive_after
        self._watcher: asyncio.Future | None = None
        self.outbox = Outbox(max_queued, on_overflow=self._on_overflow)
        self.jobs: dict[str, _Job] = {}  # unfinished jobs of this socket only
        self._ended_early: dict[str, _Job] = {}  # finished before their submit reply was read
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        # Ownership (schemas.subjects): this tab's jobs live in the namespace of the viewer's client
        # token (its NATS user, or its inbox prefix `_INBOX_<client>`; else "web"), and carry a
        # per-socket session tag, the scheduler's fairness key "<client>/<session>".
        client = client_of(nc)
        self.client = WEB_CLIENT if client == subjects.DEFAULT_CLIENT else client
        self.user = user
        self.session_tag = user_session_tag(user) if user else "s" + secrets.token_hex(8)
        self._user_jobs = user_jobs
        self.max_user_jobs = max_user_jobs
        # events dropped by the owner-epoch rule (client.epochs): a lower epoch than their job's highest, or
        # one implausibly far above it (more than MAX_EPOCH_JUMP: forged; also in the job's epochs.implausible)
        self.stale_events = 0

    @property
    def spec(self) -> ModelSpec:
        """The fleet's model spec as this session knows it now."""
        return self._spec() if self._spec is not None else MNIST_SPEC

    # ------------------------------------------------------------ sending

    def error(self, message: str, *, code: str = "bad_request", ref: Any = None, job_id: str | None = None) -> None:
        msg: dict[str, Any] = {"type": "error", "code": code, "message": message}
        if ref is not None:
            msg["ref"] = ref
        if job_id is not None:
            msg["job_id"] = job_id
        self.outbox.put(msg)

    @property
    def closer(self) -> asyncio.Future | None:
        """The closing of this socket as not reading, once the outbox overflowed (None before)."""
        return self._closer

    def _on_overflow(self) -> None:
        reason = f"not reading: over {self.outbox.max_messages} messages waiting for this socket"
        log.warning("closing a websocket: %s", reason)
        if self._close_socket is not None and not self._closed:
            # not in self._tasks: close() must not cancel the closing of the socket
            self._closer = asyncio.ensure_future(self._close_socket(CLOSE_NOT_READING, reason))

    async def run_sender(self) -> None:
        """Drain the outbox into the socket until it is closed."""
        while (item := await self.outbox.get()) is not None:
            kind, value = item
            if kind == "latest" and not isinstance(value, dict):
                try:
                    spec = self.spec
                    value = event_message(value, spec.value_range, latent=spec.space == "latent")
                except (ValueError, TypeError) as err:
                    value = {"type": "error", "code": "internal", "message": f"undrawable event: {err}"}
            try:
                await self._send(value)
            except (ConnectionError, RuntimeError):
                break

    # ------------------------------------------------------------ receiving

    def handle(self, text: Any) -> None:
        """One message from the page. Never raises for bad input: it answers with an error."""
        try:
            cmd = parse_client_message(text, self.spec)
        except BadInput as err:
            self.error(err.message, code=err.code, ref=err.ref)
            return
        if isinstance(cmd, Ping):
            self.outbox.put_latest("__pong__", {"type": "pong", **({"ref": cmd.ref} if cmd.ref is not None else {})})
        elif isinstance(cmd, Cancel):
            self._spawn(self.cancel(cmd.job_id, ref=cmd.ref))
        elif isinstance(cmd, Generate):
            if len(self.jobs) >= self.max_jobs:
                self.error(
                    f"this tab already runs {len(self.jobs)} jobs (the limit is {self.max_jobs}); "
                    "wait for one to finish or cancel it",
                    code="overloaded",
                    ref=cmd.ref,
                )
                return
            if self.max_user_jobs is not None and self._user_jobs is not None:
                running = self._user_jobs()
                if running >= self.max_user_jobs:
                    self.error(
                        f"your address already runs {running} jobs in this viewer (the limit is "
                        f"{self.max_user_jobs}, over all your tabs); wait for one to finish or cancel it",
                        code="overloaded",
                        ref=cmd.ref,
                    )
                    return
            job_id = "web" + secrets.token_hex(8)
            self.jobs[job_id] = _Job(ref=cmd.ref)  # reserve the slot now: submit runs in the background
            self._spawn(self.submit(job_id, cmd.request))

    def _spawn(self, coro) -> asyncio.Future:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _watch(self) -> None:
        """While this tab has announced jobs: ask about those silent for probe_every seconds, and
        fail (to the page) the ones the fleet has lost."""
        while not self._closed and any(j.announced for j in self.jobs.values()):
            await asyncio.sleep(self.probe_every)
            now = time.monotonic()
            silent = [
                (job_id, job)
                for job_id, job in self.jobs.items()
                if job.announced and job.probe is not None and now - job.last_event >= self.probe_every
            ]
            verdicts = await asyncio.gather(*(job.probe.check() for _, job in silent), return_exceptions=True)
            for (job_id, job), lost in zip(silent, verdicts):
                if isinstance(lost, BaseException):
                    log.warning("job %s: status probe failed: %r", job_id, lost)
                elif lost is not None and self.jobs.get(job_id) is job:
                    await self._forget(job_id)
                    await self._publish_cancel(job_id)  # a frozen coordinator may wake up: not for nobody
                    self._drop_frames(job_id)
                    self.outbox.put(event_message(FailedEvent(job_id=job_id, code=ErrorCode.UNAVAILABLE, reason=lost)))

    async def submit(self, job_id: str, request) -> None:
        """Subscribe to the job's events, then submit it; report the outcome to the page."""
        fields = {
            "job_id": job_id,
            "session": self.session_tag,
            "report_epoch": True,
            "image_parts": True,  # a result too large for one message comes in parts, put together here
            **self._latent_fields(request),
        }
        req = request.model_copy(update=fields)
        job = self.jobs.get(job_id)
        if job is None:
            return
        job.epochs.job_id = job.parts.job_id = job_id
        try:
            sub = await self.nc.subscribe(subjects.job_events(self.client, job_id), cb=self._on_event)
        except Exception as err:  # connection closed / draining
            self.jobs.pop(job_id, None)
            self.error(f"the bus is unavailable: {err}", code="unavailable", ref=job.ref)
            return
        if self._closed or self.jobs.get(job_id) is not job:  # socket closed or job cancelled meanwhile
            await unsubscribe_quietly(sub)
            return
        job.sub = sub
        try:
            reply_msg = await private_request(
                self.nc, subjects.jobs_submit(self.client), pack(req), timeout=self.submit_timeout
            )
            reply = unpack(reply_msg.data, SubmitReply, ignore_unknown=True)
            if isinstance(reply, JobAccepted) and reply.job_id != job_id:
                raise ProtocolError(ErrorCode.BAD_REPLY, f"the submit reply names job {reply.job_id!r}, not {job_id!r}")
        except Exception as err:
            await self._forget(job_id)
            self._ended_early.pop(job_id, None)
            if not _nobody_got_it(err):  # a time-out: the coordinator may have accepted it after all
                await self._publish_cancel(job_id)
            self.error(_submit_error_text(err), code=_submit_error_code(err), ref=job.ref, job_id=job_id)
            return
        if isinstance(reply, JobAccepted):
            self._announce(job_id, reply)
            return
        await self._forget(job_id)
        self._ended_early.pop(job_id, None)
        reason = reply.reason if isinstance(reply, JobRejected) else reply.message  # JobRejected | ErrorReply
        out = {"type": "rejected", "job_id": job_id, "code": reply.code.value, "message": reason}
        if job.ref is not None:
            out["ref"] = job.ref
        self.outbox.put(out)

    def _latent_fields(self, request) -> dict[str, Any]:
        """What a job on a latent fleet asks for besides the page's fields: decoded previews every
        `preview_interval` steps, and no `frame_x1` (latents the page would not draw). {} on a pixel fleet."""
        if self.spec.space != "latent":
            return {}
        return {"preview_every": preview_interval(self.preview_every, request.frame_every), "frame_x1": False}

    def _announce(self, job_id: str, accepted: JobAccepted) -> None:
        """Send `accepted` once, then whatever events came before it."""
        job = self.jobs.get(job_id) or self._ended_early.pop(job_id, None)
        if job is None or job.announced:
            return
        job.announced = True
        job.last_event = time.monotonic()
        job.epochs.owner_accepted(accepted)
        job.probe = JobProbe(
            self.nc,
            job_id,
            lost_after=self.lost_after,
            timeout=probe_timeout(self.probe_every),
            unresponsive_after=self.unresponsive_after,
            client=self.client,
            accepted=accepted,
            epochs=job.epochs,
        )
        if job_id in self.jobs and (self._watcher is None or self._watcher.done()):
            self._watcher = self._spawn(self._watch())
        msg = event_message(accepted)
        if job.ref is not None:
            msg["ref"] = job.ref
        self.outbox.put(msg)
        for ev in job.early:
            self._queue_event(job_id, ev)
        job.early.clear()

    async def _on_event(self, msg) -> None:
        parsed = subjects.parse_job_subject(msg.subject)
        job_id = parsed.job_id if parsed is not None and parsed.client == self.client else None
        job = self.jobs.get(job_id) if job_id else None
        if job is None:
            return
        try:
            ev = unpack(msg.data, JobEvent, ignore_unknown=True)
        except ProtocolError as err:
            self.error(f"undecodable event from the coordinator: {err.message}", code=err.code.value, job_id=job_id)
            return
        if ev.job_id != job_id:
            return
        if not job.epochs.admit(ev):  # from a coordinator that lost the job to another (counted, logged at debug)
            self.stale_events += 1
            return
        job.last_event = time.monotonic()
        if job.probe is not None:
            job.probe.heard()
        if isinstance(ev, JobAccepted):
            self._announce(job_id, ev)
            return
        if isinstance(ev, DonePartEvent):
            job.parts.add(ev)
            return
        if isinstance(ev, DoneEvent) and (ev := self._whole(job_id, job, ev)) is None:
            return
        terminal = isinstance(ev, (DoneEvent, FailedEvent))
        if not job.announced:
            if terminal or not job.early or not isinstance(job.early[-1], FrameEvent):
                job.early.append(ev)
            else:
                job.early[-1] = ev  # keep only the latest early frame
        else:
            if terminal:
                self.outbox.drop(job_id)  # a pending frame is superseded by the result
            self._queue_event(job_id, ev)
        if terminal:
            if not job.announced:
                self._ended_early[job_id] = job
            # Last statement: unsubscribing from inside the subscription's own callback cancels
            # the task running this callback.
            await self._forget(job_id)

    def _whole(self, job_id: str, job: _Job, done: DoneEvent) -> DoneEvent | FailedEvent | None:
        """`done` with all its images (`client.done_parts`); None while parts of it are missing (its result is
        asked for again: a status request publishes it again); the FailedEvent to show when its parts do not
        add up, or are still missing after MAX_RESULT_ASKS requests."""
        try:
            whole = job.parts.whole(done)
        except ProtocolError as err:
            return FailedEvent(job_id=job_id, code=err.code, reason=err.message)
        if whole is not None:
            return whole
        why = job.parts.incomplete(done)
        if job.parts.asks >= MAX_RESULT_ASKS:
            reason = f"{why}, still after asking for it again {job.parts.asks} times"
            return FailedEvent(job_id=job_id, code=ErrorCode.UNAVAILABLE, reason=reason)
        job.parts.asks += 1
        self._spawn(self._ask_result(job_id, REPUBLISH_GAP_S if job.parts.asks > 1 else 0.0))
        return None

    async def _ask_result(self, job_id: str, delay: float) -> None:
        """Ask for a finished job's status after `delay` s: its coordinator publishes its result again."""
        await asyncio.sleep(delay)
        try:
            await job_status(self.nc, job_id, client=self.client, timeout=probe_timeout(self.probe_every))
        except Exception as err:  # no answer: the job's probe asks again when it stays silent
            log.info("job %s: asking for its result again failed: %r", job_id, err)

    def _queue_event(self, job_id: str, ev: Any) -> None:
        """Queue one job event, coalesced: a frame replaces the job's pending frame. A frame with a decoded
        preview (latent fleets) first drops the pending frame without one (older), then takes the preview
        slot, so a slow page skips frames but still gets the latest preview, in step order."""
        if isinstance(ev, FrameEvent) and ev.preview is not None:
            self.outbox.drop(job_id)
            self.outbox.put_latest(preview_key(job_id), ev)
        else:
            self.outbox.put_latest(job_id, ev)

    def _drop_frames(self, job_id: str) -> None:
        self.outbox.drop(job_id)
        self.outbox.drop(preview_key(job_id))

    async def _forget(self, job_id: str) -> None:
        job = self.jobs.pop(job_id, None)
        if job is not None and job.sub is not None:
            await unsubscribe_quietly(job.sub)

    async def cancel(self, job_id: str, *, ref: Any = None, notify: bool = True) -> None:
        """Cancel one of this socket's unfinished jobs (plain publish of a CancelRequest)."""
        if job_id not in self.jobs:
            if notify:
                self.error(f"no running job {job_id[:80]!r} in this tab", code="bad_request", ref=ref)
            return
        await self._forget(job_id)
        self._drop_frames(job_id)
        await self._publish_cancel(job_id)
        if notify:
            msg = {"type": "cancelled", "job_id": job_id}
            if ref is not None:
                msg["ref"] = ref
            self.outbox.put(msg)

    async def _publish_cancel(self, job_id: str) -> None:
        """Tell the coordinator to drop a job this tab gave up on (plain publish; never raises)."""
        try:
            await publish_cancel(self.nc, job_id, self.client)
        except Exception as err:
            log.warning("could not publish cancel for %s: %s", job_id, err)

    async def close(self) -> None:
        """Socket gone: cancel every unfinished job of this tab and stop sending.

        (No flush here: nats-py's flusher sends the cancels at once, and a flush cancelled
        half-way by shutdown leaves a PONG future that breaks the connection's read loop.)"""
        self._closed = True
        for job_id in list(self.jobs):
            await self.cancel(job_id, notify=False)
        for task in list(self._tasks):
            task.cancel()
        self.outbox.close()


def _nobody_got_it(err: Exception) -> bool:
    """True when the submit certainly reached no coordinator (no responders, bus closed)."""
    import nats.errors

    return isinstance(err, (nats.errors.NoRespondersError, nats.errors.ConnectionClosedError))


def _submit_error_text(err: Exception) -> str:
    import nats.errors

    if isinstance(err, nats.errors.NoRespondersError):
        return f"no coordinator is running: nothing answers on {subjects.ALL_JOBS_SUBMIT}"
    if isinstance(err, nats.errors.TimeoutError):
        return "the coordinator did not answer in time; try again"
    if isinstance(err, ProtocolError):
        return f"the coordinator sent an undecodable reply: {err.message}"
    return f"submitting failed: {type(err).__name__}: {err}"


def _submit_error_code(err: Exception) -> str:
    import nats.errors

    if isinstance(err, nats.errors.NoRespondersError):
        return ErrorCode.UNAVAILABLE.value
    if isinstance(err, nats.errors.TimeoutError):
        return ErrorCode.DEADLINE_EXCEEDED.value
    if isinstance(err, ProtocolError):
        return err.code.value
    return ErrorCode.INTERNAL.value
