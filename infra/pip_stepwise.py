"""Install a requirement set one distribution at a time, so the disk never holds them all twice.

`pip install` downloads every wheel of a resolution before it installs any, so its peak disk use is
the wheels plus what they unpack to: about 11.7 GB for the XLA venv (torch 2.9.0's CUDA build pulls
~4 GB of nvidia-* wheels even on a CPU), against 7.6 GB once installed. This resolves once
(`pip install --dry-run --report`, which reads metadata only), then installs each resolved
distribution from the URL pip chose (`--no-deps`, no cache), then the project itself, then runs
`pip check`. The peak is then what is installed plus the largest single wheel.

    python infra/pip_stepwise.py -c infra/constraints-xla.txt -e '.[xla,test]'

Run it with the target venv's python; every argument is passed to pip's resolution as given.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PIP = [sys.executable, "-m", "pip"]
QUIET = ["--quiet", "--no-cache-dir", "--disable-pip-version-check"]


def resolve(args: list[str]) -> list[dict]:
    """pip's install report for `args`: the distributions it would install (metadata only)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([*PIP, "install", *QUIET, "--dry-run", "--report", str(report), *args], check=True)
        return json.loads(report.read_text())["install"]


def plan(items: list[dict]) -> tuple[list[list[str]], list[dict]]:
    """(the pip calls to make, each a list of targets; the direct requirements: the project itself).

    A target is `name @ url` with the hash pip resolved, when it gave one. Each download is a call
    of its own; local files install together in one last call (they need no download)."""
    remote, local, direct = [], [], []
    for item in items:
        if item.get("is_direct"):
            direct.append(item)
            continue
        meta, info = item["metadata"], item["download_info"]
        url = info["url"]
        hashes = info.get("archive_info", {}).get("hashes", {})
        if "sha256" in hashes and "#" not in url:
            url += f"#sha256={hashes['sha256']}"
        (local if url.startswith("file:") else remote).append(f"{meta['name']} @ {url}")
    return [[t] for t in remote] + ([local] if local else []), direct


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    items = resolve(argv)
    calls, direct = plan(items)
    print(f"pip_stepwise: {len(items)} distributions to install, {len(calls)} pip calls", flush=True)
    started = time.monotonic()
    for i, group in enumerate(calls, 1):
        label = group[0].split(" @ ")[0] if len(group) == 1 else f"{len(group)} local wheels"
        print(f"pip_stepwise: [{i}/{len(calls)}] {label}", flush=True)
        subprocess.run([*PIP, "install", *QUIET, "--no-deps", *group], check=True)
    if direct:  # the project (editable, with its extras): its requirements are all in by now
        subprocess.run([*PIP, "install", *QUIET, "--no-deps", *argv], check=True)
    subprocess.run([*PIP, "check"], check=True)
    print(f"pip_stepwise: done in {time.monotonic() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except subprocess.CalledProcessError as err:
        print(f"pip_stepwise: {' '.join(err.cmd[2:5])} ... failed (exit {err.returncode})", file=sys.stderr)
        sys.exit(err.returncode or 1)
