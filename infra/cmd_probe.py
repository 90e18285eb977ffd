"""Rerun an outside probe's attacks on the coordinator against a private fleet, and say which held.

Starts a nats-server on a free port, one `--backend sim` worker per expert and a coordinator with the
shipped defaults, all in this process, then runs each attack as a client that follows the protocol:

  quota      one client, a new `session` per job, submits long 256-image jobs until refused: it must
             stop at its client quota (256 rows, 64 queued jobs) while another client's job runs
  status     300 status requests for a finished 64-image job at once: its result must be published
             again at most once per 2 s, the surplus answered `rate_limited`
  cancel     cancels that arrive before the coordinator took the job (its submit awaiting the
             null-label probe, or still queued): the jobs must not run
  discovery  $SRV discovery whose reply subject is a job's events subject: nothing may arrive there

Prints one line per attack (held / BROKEN and what was measured; --json: one JSON document) and exits
1 when any attack was not held. The web viewer's socket limits are not probed here.

examples:
  ddm-fleet probe
  ddm-fleet probe quota status --json
"""

from __future__ import annotations

import argparse

ATTACK_NAMES = ("quota", "status", "cancel", "discovery")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("attacks", nargs="*", metavar="ATTACK", help=f"any of {', '.join(ATTACK_NAMES)} (default: all)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON document")


def run(args: argparse.Namespace) -> int:
    import asyncio
    import json
    import sys

    unknown = [a for a in args.attacks if a not in ATTACK_NAMES]
    if unknown:
        print(f"ddm-fleet probe: unknown attack {unknown[0]!r}; choose from {', '.join(ATTACK_NAMES)}", file=sys.stderr)
        return 2
    names = list(dict.fromkeys(args.attacks)) or list(ATTACK_NAMES)

    async def main() -> list[dict]:
        from fuzzing.coordinator_attacks import ATTACKS, ProbeFleet

        results = []
        async with ProbeFleet() as fleet:
            for name in names:
                results.append(await ATTACKS[name](fleet))
                if not args.json:
                    r = results[-1]
                    shown = ", ".join(f"{k}={v}" for k, v in r["figures"].items())
                    print(f"{r['attack']:<10} {'held' if r['held'] else 'BROKEN'}: {r['what']} ({shown})", flush=True)
        return results

    results = asyncio.run(main())
    if args.json:
        print(json.dumps({"attacks": results}, indent=2))
    return 0 if all(r["held"] for r in results) else 1
