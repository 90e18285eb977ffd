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
that long, not for --step-timeout.
Fair sharing across clients (the NATS user / client token, plus the viewer's socket): at most
--max-client-rows running rows and --max-client-queued-jobs waiting jobs per client, at most
--max-job-cost row-evaluations per job and --max-job-run-s seconds of running per job; freed rows go
to the client with the fewest running rows. Refusals name the limit and its value.
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
  ddm-fleet coordinator --router ... --partition ... --nats nats://10.0.0.5:4222 --max-rows 512 --step-timeout 5
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
    from bus.nats_server import default_nats_url
    from coordinator.engine import parse_cohorts

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--router", default="checkpoints/router.safetensors", metavar="PATH",
                        help="router checkpoint (.safetensors with its .json; default %(default)s)")
    parser.add_argument("--partition", default="checkpoints/partition.json", metavar="PATH",
                        help="partition manifest: number of experts and the class owners for --strategy oracle "
                             "(default %(default)s)")
    parser.add_argument("--nats", default=default_nats_url(), metavar="URL", help="NATS server, or a comma-separated list of a cluster's nodes (default: $NATS_URL or "
                             "nats://127.0.0.1:4222)")
    parser.add_argument("--name", default="coordinator", metavar="NAME",
                        help="this coordinator's name in its replies (1-128 characters, default %(default)s): give "
                             "each coordinator on a bus its own, and keep it across restarts")
    parser.add_argument("--max-rows", type=int, default=1024, metavar="N",
                        help="most images denoised at once, over all jobs (default %(default)s); a job waits in the "
                             "queue until its rows fit")
    parser.add_argument("--max-queued-jobs", type=int, default=256, metavar="N",
                        help="most jobs waiting for rows; more are rejected with `overloaded` (default %(default)s)")
    parser.add_argument("--max-client-rows", type=int, default=None, metavar="N",
                        help="most images one client runs at once (default: --max-rows); its further jobs wait, a "
                             "larger job is rejected with `too_large`. Below --max-rows it keeps rows free for others")
    parser.add_argument("--max-client-queued-jobs", type=int, default=64, metavar="N",
                        help="most jobs one client may have waiting; more are rejected with `overloaded` "
                             "(default %(default)s, at most --max-queued-jobs)")
    parser.add_argument("--max-job-cost", type=int, default=256_000, metavar="N",
                        help="most row-evaluations per job: images x steps x evaluations per step (heun 2) x experts "
                             "per row (top1/oracle 1, topk k, full all); more is rejected with `too_large` "
                             "(default %(default)s: 256 images x 1000 euler top1 steps; 0: no limit)")
    parser.add_argument("--max-job-run-s", type=float, default=600.0, metavar="S",
                        help="most seconds a job may run once started; longer fails with `deadline_exceeded` "
                             "(default %(default)s; 0: no limit)")
    parser.add_argument("--step-timeout", type=float, default=10.0, metavar="S",
                        help="seconds to wait for an expert's reply before retrying (default %(default)s)")
    parser.add_argument("--retries", type=int, default=2, metavar="N",
                        help="extra tries of a timed-out expert request; the queue group hands each try to a worker "
                             "(default %(default)s)")
    parser.add_argument("--bad-reply-retries", type=int, default=4, metavar="N",
                        help="extra tries of an expert request after unusable replies (NaN/Inf, wrong shape or "
                             "dtype), each to a worker the queue group picks (default %(default)s)")
    parser.add_argument("--request-rows", type=int, default=512, metavar="N",
                        help="most rows in one expert request (at most 512, default %(default)s); a smaller value "
                             "splits an expert's batch into concurrent requests that the queue group spreads over "
                             "several workers of that expert (one worker re-batches them)")
    parser.add_argument("--cohorts", type=parse_cohorts, default="auto", metavar="N|auto",
                        help="batches of rows out at once: the active jobs are dealt into N cohorts, so one "
                             "cohort is routed and stepped while the experts work on another (no lock-step); 1 is "
                             "the lock-step tick. Default auto: 2, or 3 once an expert has 4 known workers and 4 "
                             "from 8 (more workers per expert need more requests queued; docs/CAPACITY.md). A "
                             "job's images do not depend on it")
    parser.add_argument("--route-every", type=int, default=1, metavar="N",
                        help="ask the router every N evaluations of a job and reuse its weights in between "
                             "(default %(default)s: every evaluation). N > 1 cuts the coordinator's router cost N-fold; "
                             "it can change images (see docs/CAPACITY.md for the measured effect)")
    parser.add_argument("--speculate", choices=("on", "off"), default="on",
                        help="send each row's likely expert requests while the router runs (what its job's last "
                             "routing chose; a job's first evaluation waits), then ask for the rows the router sent "
                             "elsewhere (default %(default)s). Hides the router's time behind the experts' at no "
                             "cost to the images; a guess the router overrules costs its expert that work "
                             "(ddm_coordinator_rows_guessed_unused_total)")
    parser.add_argument("--wire-dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                        help="precision of x_t and of the velocity on the coordinator<->worker wire (default "
                             "%(default)s). float16 / bfloat16 halve the bytes; the velocity is widened to float32 "
                             "and checked for NaN/Inf here. Every worker must be of this release or later (older "
                             "ones answer `bad_request`). An x_t or velocity that overflows float16 is sent again "
                             "in float32")
    parser.add_argument("--hedge", choices=("auto", "off"), default="auto",
                        help="hedged requests (default %(default)s): a try of an expert with no reply after 1.5 x "
                             "the p99 of its recent call times (at least 0.05 s; 1 s until 20 calls are known) is sent "
                             "once more, so that another worker of its queue group can answer; the first usable "
                             "reply wins. Only for experts whose recent replies came from 2+ workers, and at most "
                             "~10%% of requests. A killed worker then costs its jobs ~that delay, not --step-timeout")
    parser.add_argument("--hedge-after-s", type=float, default=None, metavar="S",
                        help="with --hedge auto: hedge after a fixed S seconds instead of the measured p99")
    parser.add_argument("--dispatch", choices=("direct", "queue"), default="direct",
                        help="how expert requests reach workers (default %(default)s). direct: join the shortest "
                             "queue: each request goes to the worker of its expert with the fewest requests "
                             "outstanding from this coordinator, on that worker's own subject (workers are learned "
                             "from their replies; the queue group when none is known, when every known worker has 2 "
                             "outstanding, and for every 8th request, to find new workers). queue: every request "
                             "to the expert's queue group, which picks a worker at random (the behaviour before "
                             "direct subjects)")
    parser.add_argument("--metrics-port", type=int, default=None, metavar="P",
                        help="serve Prometheus text metrics on http://HOST:P/metrics (default 9478, skipped with "
                             "a warning when taken; 0 disables)")
    parser.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                        help="interface the metrics bind (default %(default)s, loopback only; 0.0.0.0 for a "
                             "Prometheus on another machine)")
    parser.add_argument("--durable", action="store_true",
                        help="durable jobs (off by default): keep each running job's checkpoint in the NATS "
                             "JetStream KV bucket ddm_jobs (on admission and every --checkpoint-every steps), so "
                             "that this coordinator's restart (same --name, at once) or another coordinator (once "
                             "this one's lease of --lease-s has expired) resumes it mid-trajectory with bit-identical "
                             "images; SIGTERM then hands the jobs over instead of failing them. Needs a server with "
                             "JetStream (exit 2 without); see docs/COORDINATOR.md")
    parser.add_argument("--checkpoint-every", type=int, default=10, metavar="N",
                        help="with --durable: solver steps between two checkpoint writes of a job (default "
                             "%(default)s); a crash repeats at most N steps of each job")
    parser.add_argument("--lease-s", type=float, default=6.0, metavar="S",
                        help="with --durable: seconds a job's ownership lease lives unrenewed (default %(default)s); "
                             "another coordinator takes a dead one's jobs within about 1.3 x S")
    parser.add_argument("--js-replicas", type=int, default=1, metavar="N",
                        help="with --durable: copies of each KV bucket on the servers of a JetStream cluster "
                             "(default %(default)s; 1-5). Use 3 with the shipped 3-node cluster.conf, so that jobs "
                             "survive the loss of a NATS node; a single server takes only 1. Fixed by the "
                             "coordinator that creates the buckets")
    parser.add_argument("--wait-experts", type=float, default=0.0, metavar="S",
                        help="before serving, wait up to S seconds for every expert to have a worker (default: don't)")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal
    import sys

    log = logging.getLogger("ddm.coordinator")
    for name, value, low in (("--max-rows", args.max_rows, 1), ("--max-queued-jobs", args.max_queued_jobs, 1),
                             ("--retries", args.retries, 0), ("--request-rows", args.request_rows, 1),
                             ("--route-every", args.route_every, 1),
                             ("--bad-reply-retries", args.bad_reply_retries, 0),
                             ("--max-client-rows", 1 if args.max_client_rows is None else args.max_client_rows, 1),
                             ("--max-client-queued-jobs", args.max_client_queued_jobs, 1),
                             ("--max-job-cost", args.max_job_cost, 0), ("--max-job-run-s", args.max_job_run_s, 0),
                             ("--metrics-port", 0 if args.metrics_port is None else args.metrics_port, 0)):
        if value < low:
            print(f"ddm-fleet coordinator: {name} must be >= {low}, got {value}", file=sys.stderr)
            return 2
    if not 1 <= len(args.name) <= 128:
        print(f"ddm-fleet coordinator: --name must be 1-128 characters, got {len(args.name)}", file=sys.stderr)
        return 2
    if args.request_rows > 512:
        print(f"ddm-fleet coordinator: --request-rows must be <= 512 (schemas.MAX_STEP_ROWS), got {args.request_rows}",
              file=sys.stderr)
        return 2
    if args.step_timeout <= 0:
        print(f"ddm-fleet coordinator: --step-timeout must be > 0, got {args.step_timeout}", file=sys.stderr)
        return 2
    if not 1 <= args.js_replicas <= 5:
        print(f"ddm-fleet coordinator: --js-replicas must be 1-5, got {args.js_replicas}", file=sys.stderr)
        return 2
    if args.checkpoint_every < 1 or not args.lease_s > 0:
        print(f"ddm-fleet coordinator: --checkpoint-every must be >= 1 and --lease-s > 0, got "
              f"{args.checkpoint_every} and {args.lease_s}", file=sys.stderr)
        return 2
    if args.hedge_after_s is not None and not args.hedge_after_s > 0:
        print(f"ddm-fleet coordinator: --hedge-after-s must be > 0 seconds, got {args.hedge_after_s}", file=sys.stderr)
        return 2

    if args.metrics_port is not None and args.metrics_port > 65535:
        print(f"ddm-fleet coordinator: --metrics-port must be a TCP port (0-65535), got {args.metrics_port}",
              file=sys.stderr)
        return 2

    async def main() -> int:
        import nats

        from coordinator.durable import JetStreamUnavailable
        from coordinator.service import Coordinator, EngineDied, load_router_and_partition, wait_for_experts
        from workers.metrics_http import DEFAULT_COORDINATOR_PORT

        if args.metrics_port is None:  # the default: best effort
            metrics = dict(metrics_port=DEFAULT_COORDINATOR_PORT, metrics_optional=True)
        else:  # asked for: must work (0: off)
            metrics = dict(metrics_port=args.metrics_port or None)
        metrics["metrics_host"] = args.metrics_host

        router, k, c2e = load_router_and_partition(args.router, args.partition)
        from bus.nats_server import nats_servers

        async def on_error(err: Exception) -> None:  # one line per bus hiccup, not a traceback
            log.warning("nats: %s: %s", type(err).__name__, err)

        nc = await nats.connect(nats_servers(args.nats), name="ddm-coordinator", max_reconnect_attempts=-1,
                                connect_timeout=5, allow_reconnect=True, error_cb=on_error, reconnect_time_wait=1,
                                pending_size=64 * 1024 * 1024)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            if args.wait_experts > 0:
                print(f"waiting up to {args.wait_experts:g} s for workers of {k} experts ...", flush=True)
                await wait_for_experts(nc, k, timeout=args.wait_experts)
            durable = dict(durable=True, checkpoint_every=args.checkpoint_every,
                           lease_s=args.lease_s, js_replicas=args.js_replicas) if args.durable else {}
            try:
                coordinator = Coordinator(router, num_experts=k, class_to_expert=c2e, nc=nc, max_rows=args.max_rows,
                                   max_queued_jobs=args.max_queued_jobs, step_timeout=args.step_timeout,
                                   retries=args.retries, request_rows=args.request_rows,
                                   bad_reply_retries=args.bad_reply_retries, max_client_rows=args.max_client_rows,
                                   max_client_queued_jobs=args.max_client_queued_jobs,
                                   max_job_cost=args.max_job_cost or None, max_job_run_s=args.max_job_run_s or None,
                                   wire_dtype=args.wire_dtype, hedge=args.hedge, hedge_after_s=args.hedge_after_s,
                                   dispatch=args.dispatch,
                                   cohorts=args.cohorts, route_every=args.route_every, speculate=args.speculate == "on",
                                   name=args.name, **metrics,
                                   **durable)
                await coordinator.__aenter__()
            except JetStreamUnavailable as err:
                print(f"ddm-fleet coordinator: --durable needs NATS JetStream on {args.nats}: {err}", file=sys.stderr,
                      flush=True)
                return 2
            async with _Entered(coordinator) as coord:
                if args.durable:  # (without --durable nothing is printed: the first line stays "ready: ...")
                    print(f"durable jobs: on (JetStream KV ddm_jobs + ddm_job_owners, R{args.js_replicas}, "
                          f"checkpoint every {args.checkpoint_every} steps, lease {coord.lease_s:g} s; resumed "
                          f"{coord.jobs_resumed} jobs)", flush=True)
                print(f"ready: coordinator for {k} experts on {args.nats} (max {args.max_rows} rows, "
                      f"{args.max_queued_jobs} queued jobs)"
                      + (f" metrics=:{coord.metrics_port}/metrics" if coord.metrics_port else ""), flush=True)
                try:
                    await coord.serve_until(stop)
                except EngineDied as err:  # every job has failed with `internal`; let the supervisor restart us
                    print(f"ddm-fleet coordinator: {err}; exiting so that a supervisor restarts it",
                          file=sys.stderr, flush=True)
                    return 1
                log.info("signal received: failing running jobs and draining")
                st = coord.status()
            print(f"stopped: {st.jobs_done} jobs done, {st.images_done} images", flush=True)
        finally:
            await nc.drain()
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
            print(f"ddm-fleet coordinator: cannot reach NATS at {args.nats}: {type(err).__name__} {err}", file=sys.stderr)
            return 1
        raise
