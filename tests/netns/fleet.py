"""A fleet spread over network-namespace hosts (tests.netns.harness): a 3-node NATS cluster running
the shipped cluster.conf (per-role users, JetStream R3), durable coordinator processes, sim expert
worker processes, and asyncio loops inside hosts for the test's clients and observers.

Every process connects to one node (its host's "nearest" one), so a test knows which links carry
which connection; the cluster itself is fully meshed over routes.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import sys
import time
import urllib.request
from pathlib import Path

from bus.nats_server import find_nats_server
from infra.nats_cluster import (
    _JETSTREAM_ON,
    _NODE_OVERRIDES,
    CONFIG_DIR,
    ROUTE_PASSWORD_VAR,
    ROUTE_URLS_VAR,
    ROUTE_USER,
    password_env,
    random_passwords,
)
from tests.netns.harness import Net

CLIENT_PORT, CLUSTER_PORT, LEAF_PORT, HTTP_PORT = 4222, 6222, 7422, 8222


def _get_json(url: str, timeout: float = 2.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


class NetnsNatsCluster:
    """nats-server on each of `hosts` (one node per host), `cluster.conf` with this host's address."""

    def __init__(self, net: Net, hosts: list[str], workdir: Path, *, jetstream: bool = True, name: str = "ddmnt"):
        self.net, self.hosts, self.workdir, self.jetstream, self.name = net, list(hosts), Path(workdir), jetstream, name
        self.passwords = random_passwords()
        self.route_password = secrets.token_hex(12)
        self.env = {**password_env(self.passwords), ROUTE_PASSWORD_VAR: self.route_password}
        routes = [f"nats-route://{ROUTE_USER}:{self.route_password}@{net.ip(h)}:{CLUSTER_PORT}" for h in self.hosts]
        self.env[ROUTE_URLS_VAR] = "[" + ", ".join(json.dumps(r) for r in routes) + "]"
        self.procs: dict[str, object] = {}

    def node_name(self, host: str) -> str:
        return f"{self.name}-{host}"

    def url(self, host: str, user: str) -> str:
        return f"nats://{user}:{self.passwords[user]}@{self.net.ip(host)}:{CLIENT_PORT}"

    def start(self, timeout: float = 60.0) -> NetnsNatsCluster:
        import os
        import subprocess

        self.workdir.mkdir(parents=True, exist_ok=True)
        for conf in CONFIG_DIR.glob("*.conf"):
            shutil.copy(conf, self.workdir / conf.name)
        for h in self.hosts:
            js = _JETSTREAM_ON.format(store_dir=self.workdir / f"js-{h}") if self.jetstream else "jetstream: disabled"
            cfg = self.workdir / f"node-{h}.conf"
            cfg.write_text(
                _NODE_OVERRIDES.format(
                    name=self.node_name(h),
                    host=self.net.ip(h),
                    port=CLIENT_PORT,
                    http_port=HTTP_PORT,
                    cluster_name=self.name,
                    cluster_port=CLUSTER_PORT,
                    route_urls_var=ROUTE_URLS_VAR,
                    leaf_port=LEAF_PORT,
                    route_user=ROUTE_USER,
                    route_password_var=ROUTE_PASSWORD_VAR,
                    jetstream=js,
                )
            )
            log = open(self.workdir / f"{h}.log", "ab")
            env = {**os.environ, **self.env, "DDM_NATS_SERVER_NAME": self.node_name(h)}
            self.procs[h] = self.net.popen(
                h, [find_nats_server(), "-c", str(cfg)], stdout=log, stderr=subprocess.STDOUT, env=env
            )
            log.close()
        self.wait_formed(timeout)
        if self.jetstream:
            self.wait_jetstream(timeout)
        return self

    def monitor(self, host: str, endpoint: str) -> dict:
        """GET a monitoring endpoint of the node on `host`, from inside that host (works while it is cut)."""
        return self.net.call(host, _get_json, f"http://{self.net.ip(host)}:{HTTP_PORT}/{endpoint}")

    def _wait(self, pred, timeout: float, what: str) -> None:
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            for h, p in self.procs.items():
                if p.poll() is not None:
                    log = (self.workdir / f"{h}.log").read_text()[-2000:]
                    raise RuntimeError(f"nats-server on {h} exited with {p.returncode}: {log}")
            try:
                if pred():
                    return
            except OSError as err:
                last = err
            time.sleep(0.1)
        raise TimeoutError(f"{what} not reached after {timeout:g} s" + (f" (last error: {last})" if last else ""))

    def routes_of(self, host: str) -> set[str]:
        return {r.get("remote_name") for r in self.monitor(host, "routez").get("routes", [])}

    def wait_formed(self, timeout: float = 60.0, hosts: list[str] | None = None) -> None:
        hosts = hosts or self.hosts
        names = {self.node_name(h) for h in hosts}
        self._wait(
            lambda: all(names - {self.node_name(h)} <= self.routes_of(h) for h in hosts),
            timeout,
            f"full mesh of {sorted(names)}",
        )

    def meta_leader(self, host: str) -> str | None:
        return (self.monitor(host, "jsz").get("meta_cluster") or {}).get("leader") or None

    def wait_jetstream(self, timeout: float = 60.0) -> None:
        def agreed() -> bool:
            seen = {self.meta_leader(h) for h in self.hosts}
            if len(seen) != 1 or None in seen:
                return False
            (lead,) = seen
            host = next(h for h in self.hosts if self.node_name(h) == lead)
            peers = self.monitor(host, "jsz").get("meta_cluster", {}).get("replicas") or []
            current = {p.get("name") for p in peers if p.get("current") and not p.get("offline")}
            return {self.node_name(h) for h in self.hosts if h != host} <= current

        self._wait(agreed, timeout, "a JetStream meta leader known to every node")

    def stream_leader(self, host: str, stream: str, account: str = "DDM") -> str | None:
        """Host of the node leading `stream`'s replicas, as the node on `host` sees it."""
        jsz = self.monitor(host, f"jsz?acc={account}&streams=true")
        for acc in jsz.get("account_details") or []:
            for st in acc.get("stream_detail") or []:
                if st.get("name") == stream:
                    lead = (st.get("cluster") or {}).get("leader")
                    return next((h for h in self.hosts if self.node_name(h) == lead), None)
        return None


async def start_process(net: Net, host: str, argv: list[str], ready: bytes, timeout: float = 180.0):
    """A process inside `host` (stdout / stderr piped); returns it once a stdout line starts with
    `ready`, with the lines before it."""
    import os

    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = await asyncio.create_subprocess_exec(
        *net.argv(host, argv), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    lines = []
    proc.err = bytearray()  # stderr, read all along (a full pipe would block the process)
    proc.drains = [asyncio.ensure_future(_drain(proc.stderr, proc.err))]
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), max(deadline - time.monotonic(), 0.1))
        except TimeoutError:
            proc.kill()
            raise AssertionError(
                f"{argv[:4]} on {host}: no {ready!r} after {timeout:g} s: {b''.join(lines)!r}"
            ) from None
        if not line:
            await proc.wait()
            await asyncio.gather(*proc.drains)
            raise AssertionError(f"{argv[:4]} on {host} exited: {(b''.join(lines) + proc.err)[-3000:]!r}")
        lines.append(line)
        if line.startswith(ready):
            proc.out = bytearray(b"".join(lines))
            proc.drains.append(asyncio.ensure_future(_drain(proc.stdout, proc.out)))
            return proc, b"".join(lines)


async def _drain(stream, into: bytearray) -> None:
    while chunk := await stream.read(65536):
        into += chunk


async def start_coordinator(net: Net, host: str, url: str, router, name: str, *extra: str):
    """A durable `ddm-fleet coordinator --name <name>` inside `host`, connected to `url`."""
    argv = [sys.executable, "-m", "infra.cli", "coordinator", "--router", str(router)]
    argv += ["--partition", "checkpoints/partition.json", "--nats", url, "--metrics-port", "0", "--name", name]
    return await start_process(net, host, argv + list(extra), b"ready: coordinator")


async def start_sim_worker(net: Net, host: str, url: str, expert: int, checkpoint, batch_ms: float):
    """A `ddm-fleet worker --backend sim` for `expert` inside `host` (`batch_ms` per batch)."""
    argv = [sys.executable, "-m", "infra.cli", "worker", "--expert", str(expert), "--checkpoint", str(checkpoint)]
    argv += ["--nats", url, "--backend", "sim", "--sim-preset", "instant", "--sim-batch-ms", str(batch_ms)]
    argv += ["--buckets", "1,4,16", "--metrics-port", "0"]
    proc, _ = await start_process(net, host, argv, b"ready: expert")
    return proc


async def stop(proc) -> bytes:
    """SIGKILL `proc` unless it ended; returns its stderr."""
    if proc.returncode is None:
        proc.kill()
    await proc.wait()
    await asyncio.wait_for(asyncio.gather(*proc.drains, return_exceptions=True), 10)
    return bytes(proc.err)


#: The hosts of the standard partition fleet, and the NATS node each one's processes connect to.
NATS_HOSTS = ["n0", "n1", "n2"]
NODE_OF = {"ca": "n0", "cb": "n1", "w0": "n0", "w1": "n1", "cl": "n1", "obs": "n1"}
HOSTS = NATS_HOSTS + list(NODE_OF)
#: durable coordinator name -> its host
COORD_HOSTS = {"ca": "ca", "cb": "cb"}


class Fleet:
    """The standard partition fleet on a fresh Net: n0 n1 n2 (NATS, JetStream R3), coordinators ca
    (on n0) and cb (on n1), a sim worker of every expert on w0 (n0) and on w1 (n1), a client loop on
    cl (n1) and an observer loop on obs (n1: reads the durable buckets); n2 serves no process, only
    routes and JetStream. Built by `start`, torn down by `close`."""

    def __init__(self, workdir: Path, experts, router, *, lease_s: float, batch_ms: float, checkpoint_every: int = 10):
        self.workdir, self.experts, self.router = Path(workdir), list(experts), router
        self.lease_s, self.batch_ms, self.checkpoint_every = lease_s, batch_ms, checkpoint_every
        self.net: Net | None = None
        self.cluster: NetnsNatsCluster | None = None
        self.coords: dict[str, object] = {}
        self.workers: dict[str, list] = {}
        self.client_nc = self.reader = None
        self._ids: list[str] = []  # the jobs submitted since the last `settle`
        self._marks: dict[str, int] = {}  # where each coordinator's log stood at the last `settle`

    async def start(self, *, client_ping_s: float | None = None) -> Fleet:
        """Build everything. `client_ping_s`: the client connection's ping interval (nats-py's is
        2 minutes: with a short one it notices a dead link and reconnects)."""
        import nats

        from client.jobs import client_connect_options

        self.net = Net(HOSTS)
        self.cluster = await asyncio.to_thread(NetnsNatsCluster(self.net, NATS_HOSTS, self.workdir / "nats").start)
        c = self.cluster
        workers = [
            start_sim_worker(self.net, h, c.url(NODE_OF[h], "worker"), k, path, self.batch_ms)
            for h in ("w0", "w1")
            for k, path in enumerate(self.experts)
        ]
        got = await asyncio.gather(*workers)
        self.workers = {"w0": got[: len(self.experts)], "w1": got[len(self.experts) :]}
        opts = ["--durable", "--js-replicas", "3", "--checkpoint-every", str(self.checkpoint_every)]
        opts += ["--lease-s", str(self.lease_s), "--step-timeout-s", "5"]
        # one at a time: the first creates the buckets (with this lease as their TTL)
        for name, host in COORD_HOSTS.items():
            proc, head = await start_coordinator(
                self.net, host, c.url(NODE_OF[host], "coordinator"), self.router, name, *opts
            )
            assert b"durable jobs: on (JetStream KV ddm_jobs + ddm_job_owners, R3" in head, head
            self.coords[name] = proc
        self.cl, self.obs = self.net.loop("cl"), self.net.loop("obs")
        ping = {} if client_ping_s is None else {"ping_interval": client_ping_s, "max_outstanding_pings": 2}

        async def connect_client():
            return await nats.connect(
                c.url(NODE_OF["cl"], "client"),
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.2,
                **ping,
                **client_connect_options("client"),
            )

        self.client_nc = await self.cl.run(connect_client())
        self.reader = await self.obs.run(
            nats.connect(c.url(NODE_OF["obs"], "coordinator"), max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        )
        return self

    def host_of(self, coord: str) -> str:
        return COORD_HOSTS[coord]

    async def settle(self, timeout: float = 120.0) -> None:
        """Make the fleet whole for the next test of a module that shares it: every link up again, the
        NATS mesh and JetStream agreed, every process alive, the client and the observer connected, no
        job of the previous test still held by a coordinator; then a fresh window on the coordinators'
        logs (`logs`)."""
        self.net.heal_all()
        procs = {**self.coords, **{f"worker {h}/{k}": p for h, ws in self.workers.items() for k, p in enumerate(ws)}}
        for name, p in procs.items():
            assert p.returncode is None, f"{name} exited with {p.returncode}: {bytes(p.err)[-3000:]!r}"
        await asyncio.to_thread(self.cluster.wait_formed, timeout)
        await asyncio.to_thread(self.cluster.wait_jetstream, timeout)
        from tests.waiting import wait_until

        await wait_until(
            lambda: self.client_nc.is_connected and self.reader.is_connected,
            timeout=timeout,
            what="the client and the observer connected",
        )
        if self._ids:
            ids = self._ids
            await wait_until(
                lambda: self.none_held(ids), timeout=timeout, interval=0.2, what="no job of the last test held"
            )
        self._ids = []
        self._marks = {name: len(p.err) for name, p in self.coords.items()}

    def logs(self) -> dict[str, bytes]:
        """Each coordinator's stderr since the last `settle` (the whole of it before any)."""
        return {name: bytes(p.err[self._marks.get(name, 0) :]) for name, p in self.coords.items()}

    async def owners(self, ids) -> dict[str, str | None]:
        from tests.coordinator.durable_procs import owners_of

        return await self.obs.run(owners_of(self.reader, ids))

    async def owners_now(self, ids) -> dict[str, str | None] | None:
        """`owners`, or None while the buckets do not answer (their stream electing a leader after a cut)."""
        import nats.errors

        try:
            return await asyncio.wait_for(self.owners(ids), 10)
        except (nats.errors.Error, TimeoutError):
            return None

    async def none_held(self, ids) -> bool:
        """No coordinator holds a lease on any of `ids` (False while the buckets do not answer)."""
        owners = await self.owners_now(ids)
        return owners is not None and not any(owners.values())

    def submit(self, req, log, **kw) -> asyncio.Future:
        """run_job(req) on the client host, delivering to `log` (and, when it has one, the events dropped for
        a stale owner epoch to `log.stale`); an asyncio future of this loop."""
        from client.jobs import run_job

        self._ids.append(req.job_id)
        kw = {"timeout": 300, "probe_every": 1.0, "lost_after": 120, "on_stale": getattr(log, "stale", None), **kw}
        return asyncio.wrap_future(self.cl.submit(run_job(self.client_nc, req, log, **kw)))

    async def reference_images(self, reqs, tag: str) -> dict:
        """The same requests run undisturbed (new ids "<tag>-<i>"), on a fleet of their own on loopback
        with the same experts and router and no latency (`durable_procs.reference_images_apart`)."""
        from tests.coordinator.durable_procs import reference_images_apart

        return await reference_images_apart(reqs, self.experts, self.router, tag)

    async def close(self) -> dict[str, bytes]:
        """Stop everything; returns each coordinator's stderr."""
        errs = {}
        for name, proc in self.coords.items():
            errs[name] = await stop(proc)
            (self.workdir / f"{name}.stderr").write_bytes(errs[name])  # kept with the test's tmp dir
        for procs in self.workers.values():
            for p in procs:
                await stop(p)
        for lp, nc in ((getattr(self, "cl", None), self.client_nc), (getattr(self, "obs", None), self.reader)):
            if lp is not None and nc is not None:
                try:
                    await asyncio.wait_for(lp.run(nc.close()), 5)
                except Exception:
                    pass
        if self.net is not None:
            self.net.close()
        return errs
