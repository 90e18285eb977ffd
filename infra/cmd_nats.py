"""NATS server tools: check the shipped configs, or run them as a loopback cluster.

  check     validate configs with `nats-server -t` (the shipped ones, or FILEs), using the
            environment for the $VARIABLES they read (passwords, server name, hub URLs).
            With --example-env, dummy values stand in for missing variables, so the check
            works on a development machine.
  cluster   run N nodes of the shipped cluster.conf on 127.0.0.1 (free ports, fresh random
            passwords, real per-role permissions) and print one URL per role; with --leaf,
            also a worker-host leaf node. Runs until Ctrl-C. For trying failover and
            permissions against real processes: point workers, coordinator and web at it.

examples:
  ddm-fleet nats check --example-env                  # every shipped config parses
  ddm-fleet nats check /etc/ddm-fleet/nats/cluster.conf   # on a hub, with nats.env exported
  ddm-fleet nats cluster --size 3 --leaf leaf-expert-0
"""

from __future__ import annotations

import argparse

RUNNABLE = ("local.conf", "single.conf", "cluster.conf", "leaf.conf", "nkeys/single-nkeys.conf")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    sub = parser.add_subparsers(dest="action", metavar="<action>", required=True)
    check = sub.add_parser("check", help="validate NATS configs with nats-server -t")
    check.add_argument(
        "files",
        nargs="*",
        metavar="FILE",
        help=f"configs to check (default: the shipped {', '.join(RUNNABLE)}; the tls/ ones "
        "need their certificate files, so name them explicitly)",
    )
    check.add_argument(
        "--example-env", action="store_true", help="fill variables missing from the environment with dummy values"
    )
    cluster = sub.add_parser("cluster", help="run the shipped cluster.conf as an N-node loopback cluster")
    cluster.add_argument("--size", type=int, default=3, help="number of nodes (default 3)")
    cluster.add_argument(
        "--leaf",
        action="append",
        default=[],
        metavar="USER",
        help="also start a leaf node linked as USER (e.g. leaf-expert-0); repeatable",
    )
    cluster.add_argument("--log-dir", default=None, metavar="DIR", help="write each server's log here")


def _example_env() -> dict[str, str]:
    from infra.nats_cluster import LEAF_LOCAL_PASSWORD_VAR, PASSWORD_VARS, ROUTE_PASSWORD_VAR, ROUTE_URLS_VAR

    env = {var: "example-password" for var in (*PASSWORD_VARS.values(), ROUTE_PASSWORD_VAR, LEAF_LOCAL_PASSWORD_VAR)}
    env["DDM_NATS_SERVER_NAME"] = "example"
    env["DDM_NATS_HUB_URLS"] = '["nats-leaf://leaf-expert-0:example@nats-1.ddm.internal:7422"]'
    env[ROUTE_URLS_VAR] = '["nats-route://route:example@nats-1.ddm.internal:6222"]'
    return env


def _check(args: argparse.Namespace) -> int:
    import os
    import sys

    from bus.nats_server import check_config
    from infra.nats_cluster import CONFIG_DIR

    files = args.files or [str(CONFIG_DIR / name) for name in RUNNABLE]
    env = {k: v for k, v in _example_env().items() if k not in os.environ} if args.example_env else None
    if not args.example_env:
        from bus.nats_server import ExamplePasswordError, refuse_example_passwords

        try:  # the deployment's own nats.env, exported: its passwords must not be the shipped examples
            refuse_example_passwords()
        except ExamplePasswordError as err:
            print(f"ddm-fleet nats check: {err}", file=sys.stderr)
            return 1
    failed = 0
    for path in files:
        try:
            check_config(path, env)
            print(f"ok      {path}")
        except (ValueError, OSError) as err:
            failed += 1
            print(f"FAILED  {path}\n        {err}", file=sys.stderr)
    if failed and not args.example_env:
        print(
            "hint: the configs read passwords from the environment (see infra/nats/nats.env.example); "
            "--example-env fills in dummies",
            file=sys.stderr,
        )
    return 1 if failed else 0


def _cluster(args: argparse.Namespace) -> int:
    import signal
    import sys

    from infra.nats_cluster import NatsCluster

    if args.size < 1:
        print(f"ddm-fleet nats cluster: --size must be >= 1, got {args.size}", file=sys.stderr)
        return 2
    from bus.nats_server import ExamplePasswordError, refuse_example_passwords

    try:
        refuse_example_passwords()
    except ExamplePasswordError as err:
        print(f"ddm-fleet nats cluster: {err}", file=sys.stderr)
        return 2
    cluster = NatsCluster(args.size, name="ddm-dev", log_dir=args.log_dir)
    try:
        cluster.start()
        leaves = [cluster.leaf(user) for user in args.leaf]
    except (KeyError, RuntimeError, TimeoutError, OSError) as err:
        cluster.stop()
        print(f"ddm-fleet nats cluster: {err}", file=sys.stderr)
        return 1
    # Explicit handlers: a SIGINT disposition inherited as "ignore" (e.g. from a supervisor) must not
    # make Ctrl-C a no-op, and both are set before we announce that Ctrl-C works.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # nor an inherited mask
    try:
        for i, node in enumerate(cluster.nodes):
            print(
                f"node {i}: {node.url}  monitor http://{node.host}:{node.http_port}  leaf port {cluster.leaf_ports[i]}"
            )
        for user, leaf in zip(args.leaf, leaves):
            print(f"leaf ({user}): {leaf.client_url}  (this host's workers; carries only what {user} may)")
        print("\nper role: node 0, then the failover list (every node, credentials in the first URL;")
        print("for programs that pass --nats through bus.nats_server.nats_servers):")
        for user in cluster.passwords:
            if not user.startswith("leaf-"):
                first, *rest = cluster.servers(user)
                print(f"  {user:12s} {first}")
                if rest:
                    print(f"  {'':12s} {','.join([first] + [u.split('@', 1)[1] for u in rest])}")
        print("\nCtrl-C stops the cluster.", flush=True)
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    return 0


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    return _check(args) if args.action == "check" else _cluster(args)
