"""The shipped nats-server configs (infra/nats/) are valid and say what the docs say.

`nats-server -c FILE -t` parses and validates a config without binding anything; each
runnable config must pass it with the variables a deployment supplies. The single-node
config is also started for real to read back its limits, and the TLS config serves a
TLS client with certificates from make-dev-certs.sh.
"""

from __future__ import annotations

import os
import re
import shutil
import ssl
import subprocess
import sys
from pathlib import Path

import pytest

from bus.nats_server import NatsServer, check_config, free_port
from infra.nats_cluster import (
    CONFIG_DIR,
    LEAF_LOCAL_PASSWORD_VAR,
    PASSWORD_VARS,
    ROUTE_PASSWORD_VAR,
    ROUTE_URLS_VAR,
    monitor,
    password_env,
    random_passwords,
)
from schemas import MAX_PAYLOAD_BYTES, MAX_STEP_ROWS, subjects

pytestmark = pytest.mark.timeout(120)

#: Configs meant to be run (the others are fragments they include).
RUNNABLE = [
    "local.conf",
    "single.conf",
    "cluster.conf",
    "leaf.conf",
    "tls/tls.conf",
    "tls/leaf-tls.conf",
    "nkeys/single-nkeys.conf",
]
FRAGMENTS = ["limits.conf", "permissions.conf", "accounts.conf", "nkeys/accounts-nkeys.conf"]
TLS_DIR = "/etc/ddm-fleet/tls/"


def deployment_env() -> dict[str, str]:
    """What systemd supplies: passwords, this node's name, the route URLs of a hub node, the hub
    URLs and local password of a leaf."""
    return {
        **password_env(random_passwords()),
        ROUTE_PASSWORD_VAR: "route-pw-1",
        ROUTE_URLS_VAR: '["nats-route://route:route-pw-1@nats-1.ddm.internal:6222", '
        '"nats-route://route:route-pw-1@nats-2.ddm.internal:6222"]',
        LEAF_LOCAL_PASSWORD_VAR: "leaf-local-pw",
        "DDM_NATS_SERVER_NAME": "nats-test-1",
        "DDM_NATS_HUB_URLS": '["nats-leaf://leaf-expert-0:pw@nats-1.ddm.internal:7422", '
        '"nats-leaf://leaf-expert-0:pw@nats-2.ddm.internal:7422"]',
    }


@pytest.fixture(scope="module")
def dev_certs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("certs")
    subprocess.run(
        ["bash", str(CONFIG_DIR / "tls" / "make-dev-certs.sh"), str(out), "localhost", "127.0.0.1"],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return out


@pytest.fixture
def config_tree(tmp_path, dev_certs) -> Path:
    """A copy of infra/nats with the TLS paths pointing at fresh dev certificates."""
    tree = tmp_path / "nats"
    shutil.copytree(CONFIG_DIR, tree)
    for conf in tree.rglob("*.conf"):
        conf.write_text(conf.read_text().replace(TLS_DIR, f"{dev_certs}/"))
    return tree


def test_every_config_file_is_covered():
    shipped = sorted(str(p.relative_to(CONFIG_DIR)) for p in CONFIG_DIR.rglob("*.conf"))
    assert shipped == sorted(RUNNABLE + FRAGMENTS), "add new configs to RUNNABLE or FRAGMENTS"


@pytest.mark.parametrize("name", RUNNABLE)
@pytest.mark.bus
def test_nats_server_accepts_config(config_tree, name):
    message = check_config(config_tree / name, deployment_env())
    assert "is valid" in message


@pytest.mark.bus
def test_missing_password_is_refused_with_its_name(config_tree):
    env = deployment_env()
    del env["DDM_NATS_WEB_PASSWORD"]
    with pytest.raises(ValueError, match="DDM_NATS_WEB_PASSWORD"):
        check_config(config_tree / "single.conf", env)


@pytest.mark.bus
def test_broken_config_is_refused(tmp_path):
    bad = tmp_path / "bad.conf"
    bad.write_text("listen: 127.0.0.1:4222\nmax_payload: {\n")
    with pytest.raises(ValueError, match="refused"):
        check_config(bad)


@pytest.mark.bus
def test_tls_paths_are_required(tmp_path):
    """Unsubstituted, tls.conf points at /etc/ddm-fleet/tls, which this box lacks: refused."""
    if Path(TLS_DIR).exists():
        pytest.skip(f"{TLS_DIR} exists on this machine")
    with pytest.raises(ValueError, match="server-cert.pem"):
        check_config(CONFIG_DIR / "tls" / "tls.conf", deployment_env())


def test_passwords_users_and_env_example_agree():
    accounts = (CONFIG_DIR / "accounts.conf").read_text()
    users = dict(re.findall(r"user:\s*([\w-]+),\s*password:\s*\$(\w+)", accounts))
    assert users == PASSWORD_VARS
    example = (CONFIG_DIR / "nats.env.example").read_text()
    assert sorted(re.findall(r"^(DDM_NATS_\w+)=", example, re.M)) == sorted(
        [*PASSWORD_VARS.values(), ROUTE_PASSWORD_VAR, ROUTE_URLS_VAR]
    )


def test_permissions_use_the_protocol_subjects():
    """A protocol version bump (ddm.v2...) must update the permissions too."""
    perms = (CONFIG_DIR / "permissions.conf").read_text()
    for subject in (
        subjects.ALL_EXPERTS,
        subjects.ALL_JOBS_SUBMIT,
        subjects.ALL_JOB_EVENTS,
        subjects.ALL_JOB_CANCELS,
        subjects.ALL_JOB_STATUS,
        subjects.FLEET_STATUS,
        subjects.expert_velocity(0),
        subjects.expert_velocity(1),
        subjects.ALL_EXPERTS_DIRECT,
        subjects.expert_velocity(0) + ".*",
        subjects.expert_velocity(1) + ".*",
    ):
        assert f'"{subject}"' in perms, subject
    used = set(re.findall(r'"(ddm\.[^"]+)"', perms))
    prefix = subjects.PREFIX + "."
    assert all(s.startswith(prefix) for s in used), f"subjects outside {prefix}*: {sorted(used)}"


def _permission_sets() -> dict[str, dict[str, set[str]]]:
    """permissions.conf as {set name: {"publish" | "subscribe": allowed subjects}}."""
    perms = (CONFIG_DIR / "permissions.conf").read_text()
    out = {}
    for name, body in re.findall(r"^(\w+_PERMISSIONS) = \{(.*?)^\}", perms, re.M | re.S):
        out[name] = {}
        for verb in ("publish", "subscribe"):
            m = re.search(verb + r":\s*\{\s*allow:\s*\[(.*?)\]", body, re.S)
            out[name][verb] = set(re.findall(r'"([^"]+)"', m.group(1))) if m else set()
    return out


def test_job_status_probe_is_allowed_wherever_cancel_is():
    """The status probe (run_job, the web viewer) goes where a cancel goes: every role that may
    publish / subscribe a job's cancel subject may do the same with its status subject; the
    coordinator serves it, clients, web and ops ask it, and workers and leaf links never see it."""
    sets = _permission_sets()
    assert {
        "COORDINATOR_PERMISSIONS",
        "CLIENT_PERMISSIONS",
        "OPS_PERMISSIONS",
        "WORKER_0_PERMISSIONS",
        "LEAF_EXPERT_0_PERMISSIONS",
    } <= set(sets), sorted(sets)
    for name, verbs in sets.items():
        for verb, allowed in verbs.items():
            for cancel in [s for s in allowed if s.endswith(".jobs.*.cancel")]:
                assert cancel.replace(".cancel", ".status") in allowed, (name, verb)
    assert subjects.ALL_JOB_STATUS in sets["COORDINATOR_PERMISSIONS"]["subscribe"]
    assert subjects.ALL_JOB_STATUS not in sets["COORDINATOR_PERMISSIONS"]["publish"]
    for name, status in (
        ("CLIENT_PERMISSIONS", f"{subjects.client_namespace('client')}.jobs.*.status"),
        ("WEB_PERMISSIONS", f"{subjects.client_namespace('web')}.jobs.*.status"),
        ("OPS_PERMISSIONS", subjects.ALL_JOB_STATUS),
    ):
        assert status in sets[name]["publish"], name
        assert status not in sets[name]["subscribe"], name
    for name, verbs in sets.items():
        if name.startswith(("WORKER_", "LEAF_")):
            assert not any("jobs" in s for s in verbs["publish"] | verbs["subscribe"]), name
    # every user file hands out these sets: nkeys and passwords alike
    for users in ("accounts.conf", "nkeys/accounts-nkeys.conf"):
        text = (CONFIG_DIR / users).read_text()
        for name in ("COORDINATOR_PERMISSIONS", "CLIENT_PERMISSIONS", "OPS_PERMISSIONS"):
            assert f"${name}" in text, (users, name)


def test_direct_worker_subjects_are_allowed_wherever_the_queue_group_is():
    """Join-shortest-queue dispatch: whoever may publish / subscribe an expert's queue-group subject
    ddm.v1.expert.<K>.velocity may do the same with its workers' direct subjects: the unscoped
    ddm.v1.expert.<K>.velocity.* (the coordinator, hub workers) or, for a leaf host's user, only those under
    its own scope ddm.v1.expert.<K>.velocity.<user>.* (its workers run --direct-scope <user>), so no host
    receives another host's direct requests; the coordinator may address both kinds. Nobody gets more than
    that expert's."""
    sets = _permission_sets()
    checked = 0
    for name, verbs in sets.items():
        leaf_user = name.removesuffix("_PERMISSIONS").lower().replace("_", "-") if name.startswith("LEAF_") else None
        for verb, allowed in verbs.items():
            for queue in [s for s in allowed if s.startswith(subjects.PREFIX + ".expert.") and s.endswith(".velocity")]:
                direct = queue + (f".{leaf_user}.*" if leaf_user else ".*")
                assert direct in allowed, (name, verb, queue, direct)
                if leaf_user:
                    assert queue + ".*" not in allowed and queue + ".>" not in allowed, (name, verb)
                checked += 1
            scoped = {"COORDINATOR_PERMISSIONS": ".*.*"}.get(name)
            extra = {s for s in allowed if s.startswith(subjects.PREFIX + ".expert.")} - {
                q
                for s in allowed
                if s.endswith(".velocity")
                for q in (s, s + (f".{leaf_user}.*" if leaf_user else ".*"), s + (scoped or ".*"))
            }
            assert not extra, (name, verb, extra)
    assert checked >= 6, checked
    assert subjects.ALL_EXPERTS_DIRECT in sets["COORDINATOR_PERMISSIONS"]["publish"]
    assert subjects.ALL_EXPERTS_DIRECT + ".*" in sets["COORDINATOR_PERMISSIONS"]["publish"]  # scoped workers
    assert subjects.expert_velocity(0) + ".*" in sets["WORKER_0_PERMISSIONS"]["subscribe"]
    assert subjects.expert_velocity(1) + ".*" not in sets["WORKER_0_PERMISSIONS"]["subscribe"]
    assert subjects.expert_velocity(0) + ".leaf-expert-0.*" in sets["LEAF_EXPERT_0_PERMISSIONS"]["subscribe"]


def test_leaf_links_may_answer_discovery_and_expert_requests_and_nothing_else():
    """Leaf links carry replies only: they may publish to `_INBOX.>` (the coordinator's expert
    requests, each with its own random reply subject) and, of every client user's own inbox, only
    the discovery part `_INBOX_<user>.d.>`: never a client's probe, status or submit replies."""
    sets = _permission_sets()
    client_inboxes = {
        s for verbs in sets.values() for s in verbs["subscribe"] if s.startswith("_INBOX_") and s.endswith(".>")
    }
    assert {"_INBOX_client.>", "_INBOX_web.>"} <= client_inboxes, client_inboxes
    want = {"_INBOX.>"} | {s[: -len(">")] + "d.>" for s in client_inboxes}
    for name in ("LEAF_EXPERT_0_PERMISSIONS", "LEAF_EXPERT_1_PERMISSIONS"):
        assert sets[name]["publish"] == want, (name, sets[name]["publish"], want)
        assert not client_inboxes & sets[name]["publish"], name


@pytest.mark.bus
def test_single_node_limits_fit_our_largest_batch(config_tree):
    """Run single.conf for real (addresses overridden) and read its limits from /varz."""
    env = deployment_env()
    srv = NatsServer(env=env)
    wrapper = config_tree / "single-test.conf"
    wrapper.write_text(
        f"include ./single.conf\nlisten: {srv.host}:{srv.port}\nhttp: {srv.host}:{srv.http_port}\n"
        f"leafnodes {{ listen: {srv.host}:{free_port()} }}\n"
    )
    srv.config_file = wrapper
    with srv:
        varz = monitor(srv, "varz")
    largest_step = MAX_STEP_ROWS * 1 * 32 * 32 * 4  # float32 rows of 1x32x32
    assert varz["max_payload"] == 8 * 1024 * 1024 >= MAX_PAYLOAD_BYTES > largest_step
    assert varz["max_pending"] >= 32 * 4 * 1024 * 1024  # 32 in-flight 4 MiB replies
    assert varz["write_deadline"] == 10 * 10**9


@pytest.mark.bus
@pytest.mark.procs
async def test_tls_config_serves_a_tls_client(config_tree, dev_certs):
    """tls.conf for real: a client trusting the dev CA connects over TLS with its password."""
    import nats

    passwords = random_passwords()
    srv = NatsServer(env={**password_env(passwords), "DDM_NATS_SERVER_NAME": "tls-test"})
    wrapper = config_tree / "tls" / "tls-test.conf"
    wrapper.write_text(
        f"include ./tls.conf\nlisten: {srv.host}:{srv.port}\nhttp: {srv.host}:{srv.http_port}\n"
        f"cluster {{ name: t, listen: {srv.host}:{free_port()}, routes: [] }}\n"
        f"leafnodes {{ listen: {srv.host}:{free_port()} }}\n"
    )
    srv.config_file = wrapper
    ctx = ssl.create_default_context(cafile=str(dev_certs / "ca.pem"))
    with srv:
        nc = await nats.connect(
            f"tls://web:{passwords['web']}@localhost:{srv.port}", tls=ctx, connect_timeout=3, allow_reconnect=False
        )
        try:
            assert nc.connected_url.scheme == "tls"
            await nc.flush()
        finally:
            await nc.close()

        # What DEPLOYMENT.md tells a process to do: trust the CA through SSL_CERT_FILE, no code.
        script = (
            "import asyncio, sys, nats\n"
            "async def main():\n"
            "    nc = await nats.connect(sys.argv[1], connect_timeout=3, allow_reconnect=False)\n"
            "    await nc.flush(); await nc.close(); print('tls ok')\n"
            "asyncio.run(main())\n"
        )
        env = {**os.environ, "SSL_CERT_FILE": str(dev_certs / "ca.pem")}
        res = subprocess.run(
            [sys.executable, "-c", script, f"tls://web:{passwords['web']}@localhost:{srv.port}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 0 and "tls ok" in res.stdout, res.stderr[-2000:]

        async def quiet(err):
            pass

        untrusting = ssl.create_default_context()  # system CAs only: the dev CA is unknown
        with pytest.raises(ssl.SSLCertVerificationError):
            await nats.connect(
                f"tls://web:{passwords['web']}@localhost:{srv.port}",
                tls=untrusting,
                connect_timeout=3,
                allow_reconnect=False,
                error_cb=quiet,
            )


# ---------------------------------------------------------------- deployment files

REPO = CONFIG_DIR.parent.parent
SYSTEMD_DIR = REPO / "infra" / "systemd"
DOCKER_DIR = REPO / "infra" / "docker"


@pytest.mark.procs
def test_systemd_units_verify(tmp_path):
    """`systemd-analyze verify` on every unit (templates through an instance), with the
    /opt/ddm-fleet paths pointed at stand-in executables: no unknown keys, no bad lines."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed")
    opt = tmp_path / "opt"
    for exe in ("venv/bin/nats-server", "venv/bin/ddm-fleet"):
        path = opt / exe
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    units = tmp_path / "units"
    units.mkdir()
    names = []
    for unit in sorted(SYSTEMD_DIR.glob("*.service")):
        (units / unit.name).write_text(unit.read_text().replace("/opt/ddm-fleet/", f"{opt}/"))
        names.append(unit.name.replace("@.", "@0a."))
    assert len(names) >= 6
    res = subprocess.run([analyze, "verify", *names], cwd=units, capture_output=True, text=True, timeout=60)
    output = (res.stdout + res.stderr).strip()
    assert res.returncode == 0 and output == "", output


def test_units_run_from_the_installed_package():
    """The units need the venv only (an installed wheel), never a source checkout."""
    for unit in sorted(SYSTEMD_DIR.glob("*.service")):
        text = unit.read_text()
        for line in text.splitlines():
            if line.startswith(("ExecStart", "ExecStartPre", "ExecStartPost", "Documentation")):
                assert "/opt/ddm-fleet/src" not in line, (unit.name, line)
            if line.startswith("ExecStart"):
                assert line.split("=", 1)[1].startswith("/opt/ddm-fleet/venv/bin/"), (unit.name, line)


def test_worker_units_pass_the_worker_flags():
    for unit in ("ddm-worker-neuron@.service", "ddm-worker-gpu@.service"):
        text = (SYSTEMD_DIR / unit).read_text()
        exec_start = next(line for line in text.splitlines() if line.startswith("ExecStart="))
        for flag in (
            "worker",
            "--expert ${DDM_EXPERT}",
            "--checkpoint ${DDM_CHECKPOINT}",
            "--backend",
            "--metrics-port ${DDM_METRICS_PORT}",
        ):
            assert flag in exec_start, (unit, flag)
        assert "--nats" not in exec_start  # the worker reads $NATS_URL from the env file itself
        assert "ExecStartPost=/opt/ddm-fleet/venv/bin/ddm-fleet wait-ready ${DDM_METRICS_PORT} --pid $MAINPID" in text
    neuron = (SYSTEMD_DIR / "ddm-worker-neuron@.service").read_text()
    for needle in (
        "PJRT_DEVICE=NEURON",
        "NEURON_CC_FLAGS=",
        "--cache_dir=/var/cache/ddm-fleet/neuron",
        "TimeoutStartSec=45min",
    ):
        assert needle in neuron


def test_units_keep_credentials_off_the_command_line():
    """No unit puts a NATS URL (user:password@) on a command line, where `ps` shows it to every
    user: ddm-fleet commands read $NATS_URL from their EnvironmentFile. The NATS units check
    their config (and refuse example passwords) with `ddm-fleet nats check` before starting."""
    for unit in sorted(SYSTEMD_DIR.glob("*.service")):
        text = unit.read_text()
        for line in text.splitlines():
            if line.startswith(("ExecStart", "ExecStartPre", "ExecStartPost", "Environment=")):
                assert "--nats" not in line and "NATS_URL" not in line, (unit.name, line)
                assert not re.search(r"://[^\s/]*@", line), (unit.name, line)
        if "ddm-fleet " in text and "nats-server -c" not in text:
            assert "EnvironmentFile=/etc/ddm-fleet/" in text, unit.name
    for unit in ("ddm-nats.service", "ddm-nats-leaf.service"):
        text = (SYSTEMD_DIR / unit).read_text()
        assert "ExecStartPre=/opt/ddm-fleet/venv/bin/ddm-fleet nats check ${DDM_NATS_CONFIG}" in text, unit


def test_shipped_example_env_files_are_refused():
    """Every example env file (systemd and nats.env.example) still holds a placeholder password;
    loaded as is, the start-up check refuses it with one line naming the variable."""
    from bus.nats_server import ExamplePasswordError, nats_servers, refuse_example_passwords

    examples = sorted(SYSTEMD_DIR.glob("env/*.env.example")) + [CONFIG_DIR / "nats.env.example"]
    refused = 0
    for path in examples:
        env = dict(re.findall(r"^(\w+)=(.*)$", path.read_text(), re.M))
        if not any("CHANGE-ME" in v or "change-me" in v for v in env.values()):
            continue
        with pytest.raises(ExamplePasswordError) as err:
            refuse_example_passwords(env.get("NATS_URL"), environ=env)
            if env.get("NATS_URL"):
                nats_servers(env["NATS_URL"])
        assert "\n" not in str(err.value) and "example password" in str(err.value), path.name
        refused += 1
    assert refused >= 6


def test_example_passwords_are_refused_wherever_they_appear():
    from bus.nats_server import ExamplePasswordError, nats_servers, refuse_example_passwords

    for url in (
        "nats://web:change-me@h:4222",
        "nats://web:CHANGE-ME@h1:4222,h2:4222",
        "tls://coordinator:change-me@h",
        "h1:4222,nats://x:CHANGE-ME@h2",
        "nats://change-me@h:4222",
    ):
        with pytest.raises(ExamplePasswordError, match="example password"):
            nats_servers(url)
    assert nats_servers("nats://web:9f0c2b7d@h1:4222,h2:4222") == [
        "nats://web:9f0c2b7d@h1:4222",
        "nats://web:9f0c2b7d@h2:4222",
    ]
    with pytest.raises(ExamplePasswordError, match="DDM_NATS_ROUTE_PASSWORD"):
        refuse_example_passwords(None, {"DDM_NATS_ROUTE_PASSWORD": "change-me"})
    with pytest.raises(ExamplePasswordError, match="DDM_NATS_HUB_URLS"):
        refuse_example_passwords(None, {"DDM_NATS_HUB_URLS": '["nats-leaf://leaf-expert-0:CHANGE-ME@n1:7422"]'})
    refuse_example_passwords("nats://web:real@h", {"DDM_NATS_WEB_PASSWORD": "a1b2c3", "OTHER": "change-me"})


def _cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DDM_NATS_", "NATS_URL"))}
    return subprocess.run(
        [sys.executable, "-m", "infra.cli", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**clean, **(env or {})},
    )


@pytest.mark.procs
def test_commands_refuse_an_example_password_at_start(tmp_path):
    """`ddm-fleet worker` with a change-me URL (flag or $NATS_URL), and `nats cluster` / `nats check`
    with a change-me password in the environment: exit non-zero with one line naming it."""
    from models.tiny import make_tiny_expert

    ck = make_tiny_expert(tmp_path / "e0", expert_id=0)
    res = _cli("worker", "--expert", "0", "--checkpoint", str(ck), "--nats", "nats://worker-0:change-me@127.0.0.1:1")
    assert res.returncode == 1 and "example password 'change-me'" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    res = _cli(
        "worker", "--expert", "0", "--checkpoint", str(ck), env={"NATS_URL": "nats://worker-0:CHANGE-ME@127.0.0.1:1"}
    )
    assert res.returncode == 1 and "example password 'CHANGE-ME'" in res.stderr, res.stderr
    res = _cli("nats", "cluster", "--size", "1", env={"DDM_NATS_WEB_PASSWORD": "change-me"})
    assert res.returncode == 2 and "DDM_NATS_WEB_PASSWORD is the example password" in res.stderr, res.stderr
    res = _cli("nats", "check", str(CONFIG_DIR / "local.conf"), env={"DDM_NATS_ROUTE_PASSWORD": "change-me"})
    assert res.returncode == 1 and "DDM_NATS_ROUTE_PASSWORD" in res.stderr, res.stderr


def wait_ready(*args) -> subprocess.CompletedProcess:
    """`ddm-fleet wait-ready ARGS` in a child process, as systemd and Docker run it."""
    return subprocess.run(
        [sys.executable, "-m", "infra.cli", "wait-ready", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.procs
def test_wait_ready_command_on_a_port():
    bad = wait_ready("nope")
    assert bad.returncode == 2 and "PORT must be 1-65535" in bad.stderr
    assert wait_ready().returncode == 2  # neither PORT nor --fleet-status
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = wait_ready(free_port(), "--pid", dead.pid, "--interval", 0.1)
    assert gone.returncode == 1 and f"process {dead.pid} exited" in gone.stderr  # worker gone before ready
    assert wait_ready(free_port(), "--timeout", 1, "--interval", 0.2).returncode == 3  # nothing listening
    assert wait_ready(free_port(), "--once").returncode == 3
    import socket

    with socket.socket() as s:  # a port that accepts connections = a ready worker
        s.bind(("127.0.0.1", 0))
        s.listen()
        res = wait_ready(s.getsockname()[1], "--pid", os.getpid(), "--timeout", 5)
    assert res.returncode == 0 and "ready" in res.stdout


@pytest.mark.procs
def test_wait_ready_command_over_http():
    """--http PATH: only a 2xx answer counts (the web viewer's /healthz is 503 while NATS is down)."""
    import http.server
    import threading

    status = {"code": 503}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status["code"] if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        assert wait_ready(port, "--http", "/healthz", "--once").returncode == 3
        assert wait_ready(port, "--http", "/other", "--once").returncode == 3
        status["code"] = 200
        assert wait_ready(port, "--http", "/healthz", "--once").returncode == 0
    finally:
        server.shutdown()
        server.server_close()
    assert wait_ready("--http", "/healthz").returncode == 2  # --http needs a PORT


@pytest.mark.slow  # ~4 s: a real coordinator process answers wait-ready
@pytest.mark.procs
async def test_wait_ready_command_asks_the_coordinator(nats_url):
    """--fleet-status URL: ready once a real coordinator answers ddm.v1.fleet.status."""
    import asyncio

    from coordinator.local_fleet import LabelRouter
    from coordinator.service import Coordinator

    def run(*a):
        return asyncio.to_thread(wait_ready, *a)

    res = await run("--fleet-status", nats_url, "--once")
    assert res.returncode == 3 and "not ready" in res.stderr  # no coordinator
    assert (await run("--fleet-status", "nats://127.0.0.1:1", "--once")).returncode == 3  # no server
    async with Coordinator(LabelRouter([0] * 5 + [1] * 5, 2), num_experts=2, nats_url=nats_url):
        res = await run("--fleet-status", nats_url, "--timeout", 20)
    assert res.returncode == 0, res.stderr


DOCKERFILES = sorted(p.name for p in DOCKER_DIR.glob("Dockerfile.*") if not p.name.endswith(".dockerignore"))


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_dockerfile_copies_existing_paths(dockerfile):
    text = (DOCKER_DIR / dockerfile).read_text()
    assert text.splitlines()[0].startswith("#") and "\nFROM " in text
    assert (DOCKER_DIR / f"{dockerfile}.dockerignore").exists(), "add a <Dockerfile>.dockerignore (keeps .venv out)"
    for line in text.splitlines():
        if line.startswith("COPY "):
            sources = line.split()[1:-1]
            for src in sources:
                assert (REPO / src).exists() or src in ("checkpoints",), f"{dockerfile}: COPY {src} not in the repo"


def _pip_installs_project(text: str) -> bool:
    return re.search(r"pip install [^\n]*\"\.(\[[^\]]*\])?\"", text) is not None


@pytest.mark.parametrize("dockerfile", [d for d in DOCKERFILES if _pip_installs_project((DOCKER_DIR / d).read_text())])
def test_image_copies_every_package_and_installs_an_extra(dockerfile):
    """An image that installs the project copies every package the wheel ships, installs
    named extras that exist (a role, not everything), and checks the CLI starts."""
    import tomllib

    text = (DOCKER_DIR / dockerfile).read_text()
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    copied = {line.split()[1] for line in text.splitlines() if line.startswith("COPY ")}
    for pattern in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]:
        assert pattern.rstrip("*") in copied, f"{dockerfile} does not COPY {pattern.rstrip('*')}"
    (group,) = re.findall(r'pip install [^\n]*"\.\[([^\]]+)\]"', text)
    defaults = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    group = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], group)
    for extra in group.split(","):
        assert extra in extras and extra not in ("all", "test"), f"{dockerfile}: extra {extra!r}"
    assert "ddm-fleet --help" in text


@pytest.mark.parametrize("dockerfile", DOCKERFILES)
def test_every_image_has_a_health_check(dockerfile):
    """docker run alone (no compose) still reports health: each image declares a HEALTHCHECK whose
    command is a real probe (`ddm-fleet wait-ready` or the NATS monitoring endpoint)."""
    text = (DOCKER_DIR / dockerfile).read_text()
    m = re.search(r"^HEALTHCHECK [^\n]*\\\n\s+CMD (.+)$", text, re.M) or re.search(
        r"^HEALTHCHECK .*CMD (.+)$", text, re.M
    )
    assert m, f"{dockerfile}: no HEALTHCHECK"
    assert "wait-ready" in text or "/healthz" in m.group(1), m.group(1)


def test_cpu_image_health_check_follows_its_role():
    text = (DOCKER_DIR / "Dockerfile.cpu").read_text()
    assert "wait-ready 8080 --http /healthz --once" in text and "wait-ready 9478 --http /metrics --once" in text
    assert "${DDM_HEALTHCHECK:-" in text  # another role overrides it


def test_compose_file_runs_each_role_with_its_own_user():
    import yaml

    compose = yaml.safe_load((DOCKER_DIR / "compose.yaml").read_text())
    services = compose["services"]
    for svc in services.values():
        assert (REPO / svc["build"]["dockerfile"]).exists()
    expected = {"coordinator": "coordinator", "worker0": "worker-0", "worker1": "worker-1", "web": "web"}
    for name, user in expected.items():
        cmd = " ".join(services[name]["command"])
        # the URL goes into the environment ($NATS_URL), never onto the command's argv
        prefix = f'export NATS_URL="nats://{user}:$${{{PASSWORD_VARS[user]}}}@nats:4222" && '
        assert cmd.startswith(prefix + f"exec ddm-fleet {name.rstrip('01')} "), cmd
        assert "--nats" not in cmd and cmd.count("@") == 1, cmd


def test_compose_publishes_ports_on_loopback_only():
    import yaml

    services = yaml.safe_load((DOCKER_DIR / "compose.yaml").read_text())["services"]
    published = {name: svc["ports"] for name, svc in services.items() if svc.get("ports")}
    assert set(published) == {"nats", "web"}, published
    for name, ports in published.items():
        for port in ports:
            assert str(port).startswith("127.0.0.1:"), (name, port)


def test_compose_services_have_health_checks():
    """Every service has a health check; the fleet waits for a healthy NATS; each image's
    build argument names an existing extra; workers open the metrics port they are probed on."""
    import tomllib

    import yaml

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    services = yaml.safe_load((DOCKER_DIR / "compose.yaml").read_text())["services"]
    for name, svc in services.items():
        test = svc.get("healthcheck", {}).get("test")
        assert test and test[0] in ("CMD", "CMD-SHELL"), f"{name} has no health check"
        for extra in svc["build"].get("args", {}).get("EXTRAS", "").split(",") if svc["build"].get("args") else []:
            assert extra in extras, (name, extra)
        if name != "nats":
            assert svc["depends_on"]["nats"]["condition"] == "service_healthy", name
            assert "ddm-fleet wait-ready" in " ".join(test), (name, test)
    for name in ("worker0", "worker1"):
        port = services[name]["healthcheck"]["test"][3]
        assert f"--metrics-port {port}" in " ".join(services[name]["command"]), name
    assert "--http /healthz" in " ".join(services["web"]["healthcheck"]["test"])
    assert "8222/healthz" in " ".join(services["nats"]["healthcheck"]["test"])


def test_cluster_helper_mirrors_every_block_setting():
    """infra/nats_cluster.py replaces cluster.conf's `cluster` and `leafnodes` blocks to set
    loopback addresses; a setting added to those blocks must be mirrored there, or the
    cluster tests would not run it."""
    from infra import nats_cluster

    text = (CONFIG_DIR / "cluster.conf").read_text()

    def keys(block: str) -> set[str]:
        body = re.search(block + r"\s*\{(.*?)\n\}", text, re.S).group(1)
        body = re.sub(r"\[.*?\]", "", body, flags=re.S)  # route lists
        nested = set(re.findall(r"^\s*(\w+)\s*\{", body, re.M))  # e.g. authorization { ... }
        body = re.sub(r"^\s*\w+\s*\{.*?^\s*\}", "", body, flags=re.S | re.M)
        return {m for m in re.findall(r"^\s*(\w+)\s*:", body, re.M)} | nested

    assert keys("cluster") == {"name", "listen", "routes", "no_advertise", "authorization"}
    assert keys("leafnodes") == {"listen", "no_advertise"}
    for key in ("name", "listen", "routes", "no_advertise: true", "authorization", "password: $"):
        assert key in nats_cluster._NODE_OVERRIDES


# ---------------------------------------------------------------- ddm-fleet nats


def _nats_cli(*argv: str) -> subprocess.CompletedProcess:
    code = (
        "import argparse, sys\n"
        "from infra import cmd_nats\n"
        "p = argparse.ArgumentParser(prog='ddm-fleet nats')\n"
        "cmd_nats.add_arguments(p)\n"
        "sys.exit(cmd_nats.run(p.parse_args(sys.argv[1:])))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDM_NATS_")}
    return subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, cwd=REPO, env=env
    )


@pytest.mark.procs
def test_nats_check_command():
    ok = _nats_cli("check", "--example-env")
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count("ok ") == 5
    missing = _nats_cli("check", str(CONFIG_DIR / "single.conf"))  # no passwords in the environment
    assert missing.returncode == 1
    assert "DDM_NATS_" in missing.stderr and "--example-env" in missing.stderr


@pytest.mark.procs
def test_nats_cluster_command_serves_until_interrupted(tmp_path):
    import signal
    import time

    code = (
        "import argparse, sys\n"
        "from infra import cmd_nats\n"
        "p = argparse.ArgumentParser()\n"
        "cmd_nats.add_arguments(p)\n"
        "sys.exit(cmd_nats.run(p.parse_args(sys.argv[1:])))\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "cluster", "--size", "2", "--leaf", "leaf-expert-0"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("Ctrl-C"):
                break
        out = "".join(lines)
        assert "node 1: nats://127.0.0.1:" in out and "leaf (leaf-expert-0)" in out, out + proc.stderr.read()
        i = next(i for i, line in enumerate(lines) if line.strip().startswith("web "))
        assert re.fullmatch(r"\s*web\s+nats://web:\w+@127\.0\.0\.1:\d+\s*", lines[i]), lines[i]
        assert re.fullmatch(r"\s*nats://web:\w+@127\.0\.0\.1:\d+,127\.0\.0\.1:\d+\s*", lines[i + 1]), lines[i + 1]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0  # generous: a loaded 2-core box stops servers slowly


def test_embedded_server_uses_the_shipped_limits():
    """bus/nats_server.py's generated config (tests, local fleet) and limits.conf agree."""
    from bus.nats_server import DEFAULT_CONFIG

    limits = (CONFIG_DIR / "limits.conf").read_text()
    for key in ("max_payload", "max_pending", "write_deadline"):
        shipped = re.search(rf"^{key}:\s*(\S+)", limits, re.M).group(1)
        embedded = re.search(rf"^{key}:\s*(\S+)", DEFAULT_CONFIG, re.M).group(1)
        assert shipped == embedded, key


@pytest.mark.bus
def test_tls_routes_trust_only_the_route_ca(config_tree, dev_certs, tmp_path):
    """tls.conf's route TLS (verify: true against route-ca.pem): a node with a route certificate
    joins; a server presenting a client certificate (signed by the clients' CA) is refused even
    when it trusts the route CA, so a client credential cannot join the cluster as a route."""
    tls_conf = (config_tree / "tls" / "tls.conf").read_text()
    cluster_block = re.search(r"^cluster \{(.*?)^\}", tls_conf, re.M | re.S).group(1)
    route_tls = re.search(r"^(\s*tls \{.*?^\s*\})", cluster_block, re.M | re.S).group(1)
    assert f"{dev_certs}/route-ca.pem" in route_tls and f"{dev_certs}/ca.pem" not in route_tls
    assert "verify: true" in route_tls
    rogue_tls = route_tls.replace("route-cert.pem", "client-cert.pem").replace("route-key.pem", "client-key.pem")

    ports = [free_port() for _ in range(3)]
    routes = ", ".join(f"nats-route://127.0.0.1:{p}" for p in ports[:2])

    def node(name: str, i: int, tls_block: str, route_list: str) -> NatsServer:
        srv = NatsServer(log_file=tmp_path / f"{name}.log")
        conf = tmp_path / f"{name}.conf"
        conf.write_text(
            f"server_name: {name}\nlisten: 127.0.0.1:{srv.port}\nhttp: 127.0.0.1:{srv.http_port}\n"
            f"cluster {{\n  name: t\n  listen: 127.0.0.1:{ports[i]}\n{tls_block}\n"
            f"  routes: [{route_list}]\n}}\n"
        )
        srv.config_file = conf
        return srv

    a = node("a", 0, route_tls, routes)
    b = node("b", 1, route_tls, routes)
    rogue = node("rogue", 2, rogue_tls, f"nats-route://127.0.0.1:{ports[0]}")
    with a, b, rogue:
        import time

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            peers = {r.get("remote_name") for r in monitor(a, "routez").get("routes", [])}
            if "b" in peers:
                break
            time.sleep(0.1)
        time.sleep(1.0)  # the rogue keeps retrying meanwhile
        peers = {r.get("remote_name") for r in monitor(a, "routez").get("routes", [])}
        assert peers == {"b"}, peers
        assert monitor(rogue, "routez").get("routes", []) == []
    log = (tmp_path / "a.log").read_text() + (tmp_path / "rogue.log").read_text()
    assert "certificate" in log.lower() or "tls" in log.lower(), log[-2000:]
