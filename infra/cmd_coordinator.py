"""Run the coordinator: router + continuous step-level batching of every job over NATS.

Serves every client's ddm.v1.c.<client>.jobs.submit (JobRequest -> JobAccepted | JobRejected),
ddm.v1.c.<client>.jobs.<id>.cancel|status (only the owning client's) and ddm.v1.fleet.status, and
publishes each job's frames and final images on its owner's ddm.v1.c.<client>.jobs.<id>.events.
Each tick it runs the router on every active row at once, sends ONE batched request per chosen
expert (all experts concurrently), combines the velocities and advances every row one solver
step; jobs join at the next tick and leave when done. Expert workers (`ddm-fleet worker`) may be
started before or after; a step whose expert has no workers falls back to the next-best expert.
Every expert reply is checked (shape, dtype, finite): a bad one is logged with the worker id it
claims and retried (--bad-reply-retries); a job no expert could serve fails with `bad_reply` or
`unavailable`. A NATS server restart costs the requests in flight a retry, not the jobs. A request with no reply
after the expert's usual p99 is sent once more (--hedge), so a killed worker stalls its jobs for about
that long, not for --step-timeout-s.
Fair sharing across clients (the NATS user / client token; a job's session, e.g. the viewer's socket,
shares its client's quotas): at most --max-client-rows running rows (default 256) and
--max-client-queued-jobs waiting jobs per client, all its sessions together (--max-session-rows /
--max-session-queued-jobs bound one session), at most --max-job-cost row-evaluations per job and
--max-job-run-s seconds of running per job; freed rows go to the client with the fewest running
rows. Refusals name the limit and its value. Each client may send --submit-rate submits and
--status-rate job status requests per second (more: `rate_limited`).
SIGTERM / Ctrl-C: running and queued jobs fail with `unavailable` ("coordinator shutting down"),
then exit 0. If the engine loop dies, every job fails with `internal`, submits are refused with
`unavailable` and the process exits 1, so that its supervisor restarts it. After a crash, a
restarted coordinator answers `unknown` to the clients asking about the jobs it lost
(ddm.v1.c.<client>.jobs.<id>.status), so they fail at once instead of waiting. Several coordinators
may share a bus (the submit queue group spreads the jobs): give each its own --name, kept across
its restarts; a client believes "unknown" only from the coordinator named in its job's `accepted`.
Prometheus metrics (ticks, rows stepped, queue depth, admissions and rejections, expert call times
and errors; see coordinator/metrics.py) are served on http://127.0.0.1:9478/metrics (--metrics-host) unless
--metrics-port says otherwise (0: off). The default port is skipped with a warning when taken;
a port given explicitly must be free.

examples:
  ddm-fleet coordinator --router checkpoints/router.safetensors --partition checkpoints/partition.json
  ddm-fleet coordinator --router ... --partition ... --nats nats://10.0.0.5:4222 --max-rows 512 --step-timeout-s 5
  ddm-fleet coordinator --router ... --partition ... --metrics-port 0        # no /metrics
  ddm-fleet coordinator --router ... --partition ... --name coord-b          # a second coordinator on the bus
  ddm-fleet coordinator --router ... --partition ... --max-client-rows 256 --max-client-queued-jobs 16
  ddm-fleet coordinator --router ... --partition ... --wire-dtype float16 --hedge-after-s 0.2
  ddm-fleet coordinator --router ... --partition ... --durable --js-replicas 3 --name coord-a   # with $NATS_URL
      listing every node of the JetStream cluster: jobs survive a coordinator or a NATS node
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from coordinator.config import CoordinatorConfig

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    CoordinatorConfig.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal
    import sys

    from bus.connect import redacted
    from coordinator.config import CoordinatorConfig

    log = logging.getLogger("ddm.coordinator")
    try:
        config = CoordinatorConfig.from_args(args)
    except ValueError as err:
        print(f"ddm-fleet coordinator: {err}", file=sys.stderr)
        return 2

    async def main() -> int:
        from bus.connect import connect, drain_or_close
        from bus.exit_watch import watch_exit
        from coordinator.durable_store import JetStreamUnavailable
        from coordinator.service import (
            Coordinator,
            EngineDied,
            load_router_and_partition,
            router_spec,
            wait_for_experts,
        )
        from models.fleet_guidance import fleet_default_guidance

        router, k, c2e = load_router_and_partition(config.router, config.partition)
        spec = router_spec(config.router)
        fleet_guidance = fleet_default_guidance(config.router)
        nc = await connect(config.nats, name="ddm-coordinator", reconnect="forever", pending_size=64 * 1024 * 1024)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            if config.wait_experts > 0:
                print(f"waiting up to {config.wait_experts:g} s for workers of {k} experts ...", flush=True)
                await wait_for_experts(nc, k, timeout=config.wait_experts)
            try:
                coordinator = Coordinator(
                    router, config, num_experts=k, class_to_expert=c2e, nc=nc, spec=spec, fleet_guidance=fleet_guidance
                )
                await coordinator.__aenter__()
            except JetStreamUnavailable as err:
                print(
                    f"ddm-fleet coordinator: --durable needs NATS JetStream on {redacted(config.nats)}: {err}",
                    file=sys.stderr,
                    flush=True,
                )
                return 2
            async with _Entered(coordinator) as coord:
                durability = config.durability
                if durability.durable:  # (without --durable nothing is printed: the first line stays "ready: ...")
                    print(
                        f"durable jobs: on (JetStream KV ddm_jobs + ddm_job_owners, R{durability.js_replicas}, "
                        f"checkpoint every {durability.checkpoint_every} steps, lease {coord.lease_s:g} s; resumed "
                        f"{coord.jobs_resumed} jobs)",
                        flush=True,
                    )
                shape = "x".join(map(str, coord.spec.sample_shape))
                print(
                    f"ready: coordinator for {k} experts on {redacted(config.nats)} (max {config.limits.max_rows} "
                    f"rows, {config.limits.max_queued_jobs} queued jobs; {shape} {coord.spec.space}, "
                    f"{coord.spec.num_classes} classes"
                    + (f", default guidance {coord.default_guidance:g}" if coord.default_guidance != 1.0 else "")
                    + ")"
                    + (f" metrics=:{coord.metrics_port}/metrics" if coord.metrics_port else ""),
                    flush=True,
                )
                try:
                    await coord.serve_until(stop)
                except EngineDied as err:  # every job has failed with `internal`; let the supervisor restart us
                    print(
                        f"ddm-fleet coordinator: {err}; exiting so that a supervisor restarts it",
                        file=sys.stderr,
                        flush=True,
                    )
                    return 1
                log.info("signal received: failing running jobs and draining")
                watch_exit(what="ddm-fleet coordinator")  # a stop that hangs says on what (stderr: the log)
                st = coord.status()
            print(f"stopped: {st.jobs_done} jobs done, {st.images_done} images", flush=True)
        finally:
            await drain_or_close(nc)
        return 0

    class _Entered:  # `async with` over a Coordinator already entered (so entering errors are told apart)
        def __init__(self, coord):
            self.coord = coord

        async def __aenter__(self):
            return self.coord

        async def __aexit__(self, *exc):
            await self.coord.__aexit__(*exc)

    try:
        return asyncio.run(main())
    except FileNotFoundError as err:
        print(f"ddm-fleet coordinator: {err}", file=sys.stderr)
        return 2
    except (ValueError, ConnectionError, OSError, TimeoutError) as err:
        print(f"ddm-fleet coordinator: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    except Exception as err:
        if type(err).__module__.startswith("nats"):
            print(
                f"ddm-fleet coordinator: cannot reach NATS at {redacted(config.nats)}: {type(err).__name__} {err}",
                file=sys.stderr,
            )
            return 1
        raise
