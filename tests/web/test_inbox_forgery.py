"""A compromised worker host cannot make the viewer give up a job.

The attack: a leaf node on a worker host sees every `$SRV.INFO` / `$SRV.STATS` request the viewer
sends (to answer it, like any worker) and so its reply subject. Were those subjects drawn from the
connection's NUID (fixed prefix, counter with a fixed step), two of them would predict the next
ones, among them the reply subject of the page's next job-status probe; a forged
`job_status {state: "unknown"}` there would make the page report "coordinator lost the job" and
cancel it. Real nats-server with the shipped configs (hub and leaf, per-role users), the real
aiohttp viewer as user `web`, a fake coordinator that answers status requests a second late (as
under load), and the attacker on the leaf's local port with the worker password.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time

import pytest

from bus.connect import flushed
from bus.inbox import DISCOVERY, discovery_inbox, private_inbox
from client.jobs import JobProbe, client_connect_options
from infra.nats_cluster import NatsCluster
from schemas import JobStatus, pack, subjects
from tests.waiting import wait_until
from tests.web.fakes import FakeCoordinator
from web.app import SESSIONS, WebConfig, create_app

pytestmark = [pytest.mark.bus, pytest.mark.timeout(120)]

_DIGITS = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def _seq(token: str) -> int:
    n = 0
    for c in token.encode():
        n = n * 62 + _DIGITS.index(c)
    return n


def _token(seq: int) -> str:
    out = bytearray(10)
    for i in reversed(range(10)):
        out[i] = _DIGITS[seq % 62]
        seq //= 62
    return out.decode()


def predict_next(observed: list[str], ahead: int = 16) -> list[str]:
    """From reply subjects seen in one poll, in the order drawn (`<prefix>.<12-char NUID prefix><10-char
    sequence>`), the next `ahead` subjects nats-py would draw from the same NUID; [] when they are no
    NUID inboxes."""
    parsed = []
    for subject in observed:
        head, _, tok = subject.rpartition(".")
        if len(tok) != 22 or any(c not in _DIGITS for c in tok.encode()):
            return []
        parsed.append((head, tok[:12], _seq(tok[12:])))
    if len(parsed) < 2 or parsed[0][:2] != parsed[-1][:2]:
        return []
    step = parsed[-1][2] - parsed[-2][2]
    if not 0 < step < 1000:
        return []
    head, nuid_prefix, last = parsed[-1]
    return [f"{head}.{nuid_prefix}{_token(last + k * step)}" for k in range(1, ahead + 1)]


class Attacker:
    """On the worker host's leaf node: watches discovery requests and, every 20 ms, sprays forged
    `unknown` statuses on the reply subjects it predicts from the latest poll's (and on random
    guesses under the same prefix), so a probe's inbox gets one while the probe waits."""

    def __init__(self, nc):
        self.nc = nc
        self.seen: list[str] = []  # discovery reply subjects observed
        self.sprayed = 0
        self._poll: list[str] = []
        self._targets: list[str] = []
        self._task: asyncio.Task | None = None
        self.forgery = pack(JobStatus(job_id="web0000000000000000", state="unknown", coordinator=""))

    async def __aenter__(self) -> Attacker:
        for subject in ("$SRV.INFO", "$SRV.STATS"):
            await self.nc.subscribe(subject, cb=self._on_request)
        await flushed(self.nc)
        self._task = asyncio.create_task(self._spray())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)

    async def _on_request(self, msg) -> None:
        if not msg.reply:
            return
        self.seen.append(msg.reply)
        if msg.subject == "$SRV.INFO":
            self._poll = [msg.reply]
            return
        self._poll.append(msg.reply)
        head = msg.reply.split(".", 1)[0]
        blind = [f"{head}.{secrets.token_hex(16)}" for _ in range(4)]
        self._targets = predict_next(self._poll) + blind

    async def _spray(self) -> None:
        while True:
            for subject in self._targets:
                await self.nc.publish(subject, self.forgery)
                self.sprayed += 1
            await asyncio.sleep(0.02)


async def _slow_status_server(nc, delay: float, asked: list[str]):
    """Answers every job status request `delay` s late, truthfully: the job is running."""

    async def on_status(msg):
        parsed = subjects.parse_job_subject(msg.subject)
        asked.append(parsed.job_id)
        await asyncio.sleep(delay)
        await msg.respond(pack(JobStatus(job_id=parsed.job_id, state="running", step=1, steps=2)))

    return await nc.subscribe(subjects.ALL_JOB_STATUS, cb=on_status)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with NatsCluster(1, name="ddm-web-forge", log_dir=tmp_path_factory.mktemp("nats-logs")) as c:
        yield c


async def test_a_worker_host_cannot_make_the_page_give_up_a_job(aiohttp_client, cluster):
    import nats

    leaf = cluster.leaf("leaf-expert-0")
    coord_nc = await nats.connect(cluster.url(0, "coordinator"), connect_timeout=2)
    evil_nc = await nats.connect(leaf.client_url, connect_timeout=2, name="compromised-worker-host")
    asked: list[str] = []
    try:
        status_sub = await _slow_status_server(coord_nc, 1.0, asked)
        async with (
            Attacker(evil_nc) as attacker,
            FakeCoordinator(coord_nc, probe=False, frame_delay=20.0, status={"active_jobs": 1}) as coordinator,
        ):
            app = create_app(WebConfig(nats_url=cluster.url(0, "web"), fleet_interval=0.3, discovery_window=0.1))
            client = await aiohttp_client(app)
            ws = await client.ws_connect("/ws")
            await ws.send_json({"type": "generate", "digits": "4,5", "steps": 2})
            seen: list[dict] = []
            job_id = None
            deadline = time.monotonic() + 30
            # until the page's probe has asked about the silent job three times (every 3 s)
            while len([j for j in asked if j == job_id]) < 3 and time.monotonic() < deadline:
                try:
                    msg = await ws.receive_json(timeout=0.5)
                except TimeoutError:
                    continue
                seen.append(msg)
                if msg["type"] == "accepted":
                    job_id = msg["job_id"]
                assert msg["type"] not in ("failed", "error", "cancelled"), msg
            assert job_id is not None and asked.count(job_id) >= 3, (job_id, asked)
            assert attacker.seen and attacker.sprayed >= 20, (len(attacker.seen), attacker.sprayed)
            assert job_id not in coordinator.cancelled
            assert [s.jobs for s in app[SESSIONS]][0].keys() == {job_id}  # the page still waits for it
            # discovery replies are asked for on their own random subjects: nothing to extrapolate from
            assert all(s.startswith(f"_INBOX_web.{DISCOVERY}.") for s in attacker.seen), attacker.seen[:4]
            assert len(set(attacker.seen)) == len(attacker.seen)
            await ws.close()
        await status_sub.unsubscribe()
    finally:
        await coord_nc.close()
        await evil_nc.close()
        leaf.stop()


async def test_a_leaf_link_reaches_a_clients_discovery_inbox_only(cluster):
    """The shipped leaf permissions: a worker host may answer `$SRV.*` discovery (`_INBOX_<user>.d.>`),
    but cannot publish to any other reply subject of a client user (probes, status, submit)."""
    import nats

    leaf = cluster.leaf("leaf-expert-1")
    web_nc = await nats.connect(cluster.url(0, "web"), connect_timeout=2, **client_connect_options("web"))
    cli_nc = await nats.connect(cluster.url(0, "client"), connect_timeout=2, **client_connect_options("client"))
    evil_nc = await nats.connect(leaf.client_url, connect_timeout=2, name="compromised-worker-host")
    try:
        got: list[str] = []

        async def on_msg(msg):
            got.append(msg.subject)

        await web_nc.subscribe("_INBOX_web.>", cb=on_msg)
        await cli_nc.subscribe("_INBOX_client.>", cb=on_msg)
        await flushed(web_nc)
        await flushed(cli_nc)
        probe_web, probe_cli = private_inbox(web_nc), private_inbox(cli_nc)
        disc_web, disc_cli = discovery_inbox(web_nc), discovery_inbox(cli_nc)
        forged = pack(JobStatus(job_id="web0000000000000000", state="unknown"))

        async def published_ok():  # until the interest of both subscribers has come down the leaf link
            for subject in (probe_web, probe_cli, disc_web, disc_cli):
                await evil_nc.publish(subject, forged)
            await evil_nc.flush()
            await asyncio.sleep(0.1)
            return disc_web in got and disc_cli in got

        await wait_until(published_ok, timeout=15, interval=0.2, what="discovery replies across the leaf link")
        await asyncio.sleep(0.3)
        assert probe_web not in got and probe_cli not in got, got
        assert json.dumps(sorted(set(got))) == json.dumps(sorted({disc_web, disc_cli}))
    finally:
        for c in (web_nc, cli_nc, evil_nc):
            await c.close()
        leaf.stop()


async def test_a_status_reply_about_another_job_is_dropped_and_counted(nc):
    """Whatever reaches a probe's inbox, a status about another job is never acted on: a forged
    `unknown` that names another job (first) loses to the coordinator's true `running` (later)."""
    answered: list[str] = []

    async def on_status(msg):
        parsed = subjects.parse_job_subject(msg.subject)
        answered.append(parsed.job_id)
        await nc.publish(msg.reply, pack(JobStatus(job_id="someone-elses-job", state="unknown")))
        await asyncio.sleep(0.2)
        await nc.publish(msg.reply, pack(JobStatus(job_id=parsed.job_id, state="running", step=1, steps=9)))

    sub = await nc.subscribe(subjects.job_status("anon", "j-mine"), cb=on_status)
    await flushed(nc)
    try:
        probe = JobProbe(nc, "j-mine", client="anon", timeout=2.0)
        assert await probe.check() is None
        assert probe.last is not None and probe.last.job_id == "j-mine" and probe.last.state == "running"
        assert probe.forged == 1 and answered == ["j-mine"]
    finally:
        await sub.unsubscribe()
