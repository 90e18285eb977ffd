"""Run the whole local fleet in one command (what `make demo` runs).

Starts, each as its own process: a nats-server (infra/nats/local.conf, loopback only, no auth,
with JetStream storing under --js-store, default out/nats-js), one `ddm-fleet worker` per expert
checkpoint (expert 0 on torch, expert 1 on jax, like the reference demo's two frameworks;
--backend-K picks another, unset experts alternate torch/jax), the `ddm-fleet coordinator` and the
`ddm-fleet web` page, and for a latent fleet (the router's spec says `space: latent`) one
`ddm-fleet decoder` of `<DIR>/autoencoder.safetensors` (or of a diffusers AutoencoderKL directory
`<DIR>/vae/`), which must be the autoencoder the spec names.
Waits until each is ready (the bus accepts connections, every worker and decoder answers
$SRV.PING, the coordinator answers ddm.v1.fleet.status, the page answers HTTP 200), then prints
what runs where and the URL to open.

On a host without accelerators whose cores the fleet fills (at most its worker processes + 2), with one
worker per expert, the coordinator runs one cohort (`--cohorts 1`; docs/CAPACITY.md, "Cohorts on one small
host") unless --coordinator-args sets --cohorts.

Jobs are durable by default (`ddm-fleet coordinator --durable`, docs/COORDINATOR.md): the coordinator
checkpoints every running job in JetStream, so a coordinator that crashes and is restarted here resumes
its jobs mid-trajectory (clients see a pause, then the same images), and Ctrl-C hands running jobs
over to the next `ddm-fleet up` on the same --js-store instead of failing them. --no-durable runs
the bus without JetStream and the coordinator without checkpoints (failed jobs on a crash, as before).

A child that crashes is reported (exit code, last lines of its log) and restarted with backoff;
after --max-crashes fast crashes it is given up (a worker: the rest keeps running; the bus, the
coordinator or the web: everything stops, exit 1). Ctrl-C / SIGTERM stops every child in reverse
order (SIGTERM, then SIGKILL after --stop-timeout; a second Ctrl-C kills at once) and exits 0.
Logs: --log-dir/<process>.log.

examples:
  ddm-fleet up                                  # checkpoints/, http://127.0.0.1:8080/
  ddm-fleet up --workers 2 --backend-1 torch    # two torch workers per expert
  ddm-fleet up --checkpoints ck --port 8081 --nats-port 4333 --buckets 1,2,4,8 --follow
  ddm-fleet up --no-durable                     # no JetStream, no job checkpoints
  ddm-fleet generate --digits 3,7 --nats nats://127.0.0.1:4222 --out grid.png   # from another shell
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import sys
from pathlib import Path

from workers.config import BACKENDS, add_buckets_option  # BACKENDS: what `--backend-K` accepts (sim: simulated)

MAX_BACKEND_FLAGS = 8  # --backend-0 ... --backend-7
CONFIG = Path(__file__).resolve().parent / "nats" / "local.conf"
#: Options whose value is a child's command line; `ddm-fleet` joins `--worker-args --bf16` into
#: `--worker-args=--bf16` before parsing (infra/cli.py), so a value starting with "-" is taken.
VALUE_OPTIONS = ("--worker-args", "--coordinator-args", "--web-args")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from bus.options import add_switch

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--checkpoints",
        default="checkpoints",
        metavar="DIR",
        help="expert<K>.safetensors, router.safetensors, partition.json (default %(default)s)",
    )
    parser.add_argument("--workers", type=int, default=1, metavar="N", help="worker processes per expert (default 1)")
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="web page interface (default %(default)s; 0.0.0.0 serves other machines; NATS stays on loopback)",
    )
    parser.add_argument("--port", type=int, default=8080, help="web page port (default %(default)s)")
    parser.add_argument(
        "--nats-port",
        type=int,
        default=4222,
        metavar="P",
        help="nats-server client port on 127.0.0.1 (default %(default)s, what other commands' --nats default to)",
    )
    parser.add_argument(
        "--nats-monitor-port",
        type=int,
        default=8222,
        metavar="P",
        help="nats-server monitoring HTTP port (default %(default)s; 0 = off)",
    )
    for k in range(MAX_BACKEND_FLAGS):
        default_help = (
            f"backend of expert {k}'s workers: torch | xla | jax | sim (default {_default_backend(k)})"
            if k < 2
            else argparse.SUPPRESS
        )
        parser.add_argument(f"--backend-{k}", choices=BACKENDS, default=None, metavar="NAME", help=default_help)
    add_buckets_option(
        parser,
        default=None,
        help="workers' warmed batch sizes, e.g. 1,2,4,8 (default: the worker's own; fewer = faster start)",
    )
    parser.add_argument(
        "--worker-args",
        default="",
        metavar="ARGS",
        help='extra `ddm-fleet worker` options for every worker, e.g. "--dtype float32 --threads 1"',
    )
    parser.add_argument(
        "--coordinator-args",
        default="",
        metavar="ARGS",
        help='extra `ddm-fleet coordinator` options, e.g. "--max-rows 256"',
    )
    parser.add_argument("--web-args", default="", metavar="ARGS", help="extra `ddm-fleet web` options")
    add_switch(parser, "web", default=True, help="start the web page")
    add_switch(
        parser,
        "durable",
        default=True,
        help="durable jobs: JetStream on the bus and a `--durable` coordinator, which checkpoints running "
        "jobs and resumes them after a crash; --no-durable: a coordinator crash fails its running jobs",
    )
    parser.add_argument(
        "--js-store",
        default="out/nats-js",
        metavar="DIR",
        help="the nats-server's JetStream store: the durable jobs' checkpoints, kept across runs (default %(default)s)",
    )
    parser.add_argument(
        "--log-dir",
        default="out/up",
        metavar="DIR",
        help="children's logs, one <process>.log each (default %(default)s)",
    )
    parser.add_argument("--follow", action="store_true", help="also echo every child's log lines, prefixed")
    parser.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="longest wait for one process to become ready (default %(default)s; the jax "
        "worker compiling every bucket is the slow one: about 90 s on a 2-core CPU)",
    )
    parser.add_argument(
        "--stop-timeout",
        type=float,
        default=20.0,
        metavar="S",
        help="seconds after SIGTERM before a child gets SIGKILL (default %(default)s)",
    )
    parser.add_argument(
        "--max-crashes",
        type=int,
        default=4,
        metavar="N",
        help="give up on a child after N crashes within 60 s (default %(default)s)",
    )
    parser.epilog = (
        "--backend-2 ... --backend-7 exist too; experts without one alternate torch, jax.\n"
        "The bus has no authentication and listens on 127.0.0.1 only; see docs/DEPLOYMENT.md for "
        "real hosts."
    )


def _default_backend(k: int) -> str:
    return ("torch", "jax")[k % 2]


class UpError(Exception):
    """A problem found before anything starts (exit 2)."""


def check_checkpoints(directory: str | os.PathLike) -> dict:
    """{"experts": [Path, ...], "router": Path, "partition": Path}; UpError naming every missing file."""
    d = Path(directory)
    router, partition = d / "router.safetensors", d / "partition.json"
    missing = [p for p in (router, router.with_suffix(".json"), partition) if not p.exists()]
    k = None
    if partition.exists():
        try:
            k = int(json.loads(partition.read_text())["num_experts"])
        except (ValueError, KeyError, TypeError) as err:
            raise UpError(
                f"{partition} is not a partition manifest ({type(err).__name__}: {err}); see checkpoints/README.md"
            ) from None
    experts = []
    for i in range(k if k is not None else 2):
        ck = d / f"expert{i}.safetensors"
        missing += [p for p in (ck, ck.with_suffix(".json")) if not p.exists()]
        experts.append(ck)
    if missing:
        raise UpError(
            "missing checkpoint files: " + ", ".join(map(str, missing)) + ". Train them with the "
            "commands in checkpoints/README.md, or pass --checkpoints DIR."
        )
    if k is not None and k < 1:
        raise UpError(f"{partition} says num_experts={k}")
    out = {"experts": [p.resolve() for p in experts], "router": router.resolve(), "partition": partition.resolve()}
    autoencoder = latent_decoder(d, router)
    if autoencoder is not None:
        out["autoencoder"] = autoencoder
    return out


def latent_decoder(d: Path, router: Path) -> tuple[Path, str] | None:
    """(autoencoder checkpoint, content hash) when the router's spec says space latent: the fleet
    needs a decoder, served from `<DIR>/autoencoder.safetensors`, or from a diffusers AutoencoderKL
    directory `<DIR>/vae/` when there is no such file; None for a pixel fleet.
    UpError when the autoencoder is missing or is not the one the spec names."""
    from coordinator.startup import router_spec
    from models.autoencoder import AutoencoderError
    from models.codec import codec_info, fleet_codec

    try:
        spec = router_spec(router)
    except (ValueError, OSError) as err:
        raise UpError(f"{router.with_suffix('.json')}: {err}") from None
    try:
        ae = fleet_codec(spec, [d])
    except AutoencoderError as err:
        raise UpError(f"a latent fleet needs its autoencoder (the decoder serves it): {err}") from None
    return None if ae is None else (ae.resolve(), codec_info(ae).content_hash)


def check_port_free(host: str, port: int, what: str, flag: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers do: TIME_WAIT is no conflict
        try:
            s.bind((host, port))
        except OSError as err:
            raise UpError(
                f"{what} port {host}:{port} is in use ({err.strerror}): another `ddm-fleet up` or "
                f"server holds it; stop it or pass {flag} P"
            ) from None


def shared_cpu_cohorts(
    coordinator_args: str,
    workers_per_expert: int,
    worker_processes: int,
    *,
    cpu_count: int | None = None,
    accelerator: bool | None = None,
) -> list[str]:
    """Coordinator options for a fleet whose processes all share a few CPU cores: ["--cohorts", "1"] where
    `coordinator.cohorts.cohorts_on_shared_cores` says so for this host (`cpu_count`, `accelerator`: None =
    probe it) and the user set no --cohorts; else []."""
    from coordinator.cohorts import cohorts_on_shared_cores
    from models.precision import host_has_accelerator

    if "--cohorts" in coordinator_args:
        return []
    cores = (os.cpu_count() or 1) if cpu_count is None else cpu_count
    accelerator = host_has_accelerator() if accelerator is None else accelerator
    n = cohorts_on_shared_cores(workers_per_expert, worker_processes, cores=cores, accelerator=accelerator)
    return [] if n is None else ["--cohorts", str(n)]


def build_stages(args: argparse.Namespace, ck: dict, nats_bin: str, probes) -> list[list]:
    from infra.launcher import ChildSpec
    from schemas import subjects

    nats_url = f"nats://127.0.0.1:{args.nats_port}"
    cli = [sys.executable, "-m", "infra.cli"] + (["-v"] if args.verbose else [])
    env = {"NATS_URL": nats_url}
    monitor = f" (monitor http://127.0.0.1:{args.nats_monitor_port})" if args.nats_monitor_port else ""
    durable = getattr(args, "durable", True)
    # JetStream from the command line (local.conf has none): -js, its store
    store = Path(getattr(args, "js_store", "out/nats-js")).resolve()
    jetstream = ["-js", "-sd", str(store)] if durable else []
    bus = ChildSpec(
        "nats-server",
        [
            nats_bin,
            "-c",
            str(CONFIG),
            "-a",
            "127.0.0.1",
            "-p",
            str(args.nats_port),
            "-m",
            str(args.nats_monitor_port),
            *jetstream,
        ],
        role="bus",
        where=nats_url + monitor + (" JetStream" if durable else ""),
        probe=probes.port(args.nats_port),
    )
    rest = []
    for k, path in enumerate(ck["experts"]):
        backend = getattr(args, f"backend_{k}", None) if k < MAX_BACKEND_FLAGS else None
        backend = backend or _default_backend(k)
        for i in range(args.workers):
            argv = cli + [
                "worker",
                "--expert",
                str(k),
                "--checkpoint",
                str(path),
                "--backend",
                backend,
                "--nats",
                nats_url,
            ]
            argv += (["--buckets", args.buckets] if args.buckets else []) + shlex.split(args.worker_args)
            rest.append(
                ChildSpec(
                    f"worker-e{k}-{i}",
                    argv,
                    role=f"expert {k}",
                    backend=backend,
                    where=subjects.expert_velocity(k),
                    probe=probes.worker,
                    critical=False,
                    env=env,
                    stop_group="workers",
                )
            )
    if ck.get("autoencoder"):  # a latent fleet: one decoder (add more with `ddm-fleet decoder`)
        ae, digest = ck["autoencoder"]
        rest.append(
            ChildSpec(
                "decoder-0",
                cli + ["decoder", "--checkpoint", str(ae), "--nats", nats_url],
                role="decoder",
                where=subjects.decoder_decode(digest),
                probe=probes.decoder,
                critical=False,
                env=env,
                stop_group="workers",
            )
        )
    coord = (
        cli
        + ["coordinator", "--router", str(ck["router"]), "--partition", str(ck["partition"]), "--nats", nats_url]
        + (["--durable"] if durable else [])
        + shared_cpu_cohorts(args.coordinator_args, args.workers, len(ck["experts"]) * args.workers)
        + shlex.split(args.coordinator_args)
    )
    rest.append(
        ChildSpec(
            "coordinator", coord, role="coordinator", where=subjects.ALL_JOBS_SUBMIT, probe=probes.coordinator, env=env
        )
    )
    if args.web:
        web = (
            cli
            + ["web", "--host", args.host, "--port", str(args.port), "--nats", nats_url]
            + shlex.split(args.web_args)
        )
        rest.append(
            ChildSpec(
                "web",
                web,
                role="web",
                where=page_url(args.host, args.port),
                probe=probes.http(args.host, args.port),
                env=env,
            )
        )
    return [[bus], rest]


def page_url(host: str, port: int) -> str:
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/"


class Probes:
    """Readiness checks; one NATS connection shared by all of them (opened on first use)."""

    def __init__(self, nats_url: str):
        self.nats_url = nats_url
        self.nc = None

    def port(self, port: int):
        async def probe(child) -> bool:
            import asyncio

            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 1.0)
            except (TimeoutError, OSError):
                return False
            writer.close()
            return True

        return probe

    def http(self, host: str, port: int):
        async def probe(child) -> bool:
            import asyncio

            target = "127.0.0.1" if host in ("0.0.0.0", "") else host
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(target, port), 1.0)
            except (TimeoutError, OSError):
                return False
            try:
                writer.write(f"GET / HTTP/1.0\r\nHost: {target}:{port}\r\n\r\n".encode())
                await writer.drain()
                status = await asyncio.wait_for(reader.readline(), 2.0)
                return status.split()[1:2] == [b"200"]
            except (TimeoutError, OSError, IndexError):
                return False
            finally:
                writer.close()

        return probe

    async def _conn(self):
        if self.nc is None or self.nc.is_closed:
            from bus.connect import connect

            async def quiet(err: Exception) -> None:  # the bus restarting is reported by the supervisor
                pass

            # probed only once the bus answers; a BusUnavailable here is a failed probe, tried again later
            self.nc = await connect(
                self.nats_url,
                name="ddm-up",
                reconnect="forever",
                first_connect_attempts=4,
                connect_timeout_s=2,
                reconnect_wait_s=0.5,
                error_cb=quiet,
            )
        return self.nc

    async def worker(self, child) -> bool:
        """The worker printed `ready: ... service_id=ID` and that service answers $SRV.PING."""
        import re

        m = re.search(r"^ready: .*service_id=(\S+)", child.log_since_start(), re.M)
        if not m:
            return False
        nc = await self._conn()
        await nc.request(f"$SRV.PING.ddm-expert.{m.group(1)}", b"", timeout=1.0)
        return True

    async def decoder(self, child) -> bool:
        """The decoder printed `ready: decoder ... service_id=ID` and that service answers $SRV.PING."""
        import re

        m = re.search(r"^ready: decoder .*service_id=(\S+)", child.log_since_start(), re.M)
        if not m:
            return False
        nc = await self._conn()
        await nc.request(f"$SRV.PING.ddm-decoder.{m.group(1)}", b"", timeout=1.0)
        return True

    async def coordinator(self, child) -> bool:
        from client.jobs import fleet_status

        await fleet_status(await self._conn(), timeout=1.0)
        return True

    async def close(self) -> None:
        if self.nc is not None and not self.nc.is_closed:
            try:
                await self.nc.close()
            except Exception:
                pass


async def _follow(sup, interval: float = 0.25) -> None:
    """Echo new log lines of every child, prefixed with its name."""
    import asyncio

    offsets: dict = {}
    width = max((len(s.name) for st in sup.stages for s in st), default=8)
    while True:
        for c in list(sup.children):
            try:
                size = c.log_path.stat().st_size
            except OSError:
                continue
            pos = offsets.get(c.name, 0)
            if size < pos:
                pos = 0
            if size > pos:
                with open(c.log_path, "rb") as f:
                    f.seek(pos)
                    data = f.read(size - pos)
                cut = data.rfind(b"\n") + 1  # whole lines only
                for line in data[:cut].decode("utf-8", "replace").splitlines():
                    print(f"{c.name.ljust(width)} | {line}", flush=True)
                offsets[c.name] = pos + cut
        await asyncio.sleep(interval)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from bus.nats_server import find_nats_server
    from infra.launcher import RestartPolicy, Supervisor

    try:
        if args.workers < 1:
            raise UpError(f"--workers must be >= 1, got {args.workers}")
        for flag, port in (("--port", args.port), ("--nats-port", args.nats_port)):
            if not 0 < port < 65536:
                raise UpError(f"{flag} must be 1-65535, got {port}")
        if not 0 <= args.nats_monitor_port < 65536:
            raise UpError(f"--nats-monitor-port must be 0-65535, got {args.nats_monitor_port}")
        ck = check_checkpoints(args.checkpoints)
        try:
            nats_bin = find_nats_server()
        except FileNotFoundError as err:
            raise UpError(str(err)) from None
        check_port_free("127.0.0.1", args.nats_port, "NATS", "--nats-port")
        if args.nats_monitor_port:
            check_port_free("127.0.0.1", args.nats_monitor_port, "NATS monitoring", "--nats-monitor-port")
        if args.web:
            check_port_free(args.host, args.port, "web", "--port")
        for name in ("worker_args", "coordinator_args", "web_args"):
            shlex.split(getattr(args, name))  # raises ValueError on unbalanced quotes
        if args.durable:
            try:
                Path(args.js_store).mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise UpError(
                    f"--js-store {args.js_store}: cannot create it ({err.strerror}); pass another DIR or --no-durable"
                ) from None
        policy = RestartPolicy(max_crashes=args.max_crashes)
    except (UpError, ValueError) as err:
        print(f"ddm-fleet up: {err}", file=sys.stderr)
        return 2

    probes = Probes(f"nats://127.0.0.1:{args.nats_port}")
    stages = build_stages(args, ck, nats_bin, probes)
    log_dir = Path(args.log_dir).resolve()
    url = page_url(args.host, args.port) if args.web else None

    def on_ready(sup: Supervisor) -> None:
        print("", flush=True)
        for line in sup.table():
            print(line, flush=True)
        print(f"\nlogs: {log_dir}/<process>.log", flush=True)
        if url:
            print(f"fleet ready: open {url}  (Ctrl-C stops everything)", flush=True)
        else:
            print(f"fleet ready: NATS {probes.nats_url}  (Ctrl-C stops everything)", flush=True)

    async def main() -> int:
        sup = Supervisor(
            stages,
            log_dir,
            ready_timeout=args.ready_timeout,
            stop_timeout=args.stop_timeout,
            policy=policy,
            on_ready=on_ready,
            on_stopping=probes.close,
        )
        n = sum(len(s) for s in stages)
        print(f"ddm-fleet up: starting {n} processes (logs in {log_dir}); waiting until each is ready ...", flush=True)
        follower = asyncio.create_task(_follow(sup)) if args.follow else None
        try:
            return await sup.run()
        finally:
            if follower:
                follower.cancel()
                await asyncio.gather(follower, return_exceptions=True)
            await probes.close()

    try:
        return asyncio.run(main())
    except OSError as err:
        print(f"ddm-fleet up: {err}", file=sys.stderr)
        return 1
