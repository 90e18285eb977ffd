"""Engines for the pure (in-process) targets `codec` and `messages`.

`atheris` is coverage-guided libFuzzer, run in a child process (`python -m fuzzing.engines
atheris-child ...`) since atheris.Fuzz() never returns; `random` is the structure-aware generator of
`fuzzing.inputs` alone, in this process.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .result import FuzzResult, progress_bar


def atheris_available() -> tuple[bool, str]:
    try:
        import atheris  # noqa: F401
    except Exception as err:  # ImportError, or a broken native build
        return False, f"{type(err).__name__}: {err}"
    return True, ""


def run_pure_random(target: str, runs: int, seed: int, progress: bool = False) -> FuzzResult:
    import traceback

    from fuzzing.inputs import PURE_TARGETS, pure_inputs

    one = PURE_TARGETS[target]
    gen = pure_inputs(target, random.Random(f"{target}:{seed}"))
    res = FuzzResult(target, "random", runs)
    start = time.perf_counter()
    with progress_bar(runs, target, progress) as bar:
        for _ in range(runs):
            data = gen()
            res.tried += 1
            try:
                res.count(*one(data))
            except Exception as err:
                res.crash(data, f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=-4)}")
            bar.update(1)
    res.wall_s = time.perf_counter() - start
    return res


def run_pure_atheris(target: str, runs: int, seed: int, progress: bool = False, timeout_s: float = 3600) -> FuzzResult:
    """Run atheris in a child (libFuzzer exits the process when done) and read its counts."""
    res = FuzzResult(target, "atheris", runs)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"ddm-fuzz-{target}-") as tmp:
        stats = Path(tmp) / "stats.json"
        artifacts = Path(tmp) / "artifacts"
        artifacts.mkdir()
        logfile = Path(tmp) / "libfuzzer.log"
        cmd = [
            sys.executable,
            "-m",
            "fuzzing.engines",
            "atheris-child",
            target,
            str(runs),
            str(seed),
            str(stats),
            str(Path(tmp) / "corpus"),
            str(artifacts),
        ]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]),
        }
        with open(logfile, "wb") as out, progress_bar(runs, f"{target} (atheris)", progress) as bar:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
            seen = 0
            while proc.poll() is None:
                if time.perf_counter() - start > timeout_s:
                    proc.kill()
                    proc.wait()
                    break
                time.sleep(0.2)
                now = _read_stats(stats).get("tried", seen)
                bar.update(now - seen)
                seen = now
            final = _read_stats(stats)
            bar.update(final.get("tried", seen) - seen)
        for key in ("tried", "ok", "clear", "crashes"):
            setattr(res, key, int(final.get(key, 0)))
        res.codes = final.get("codes", {})
        res.oks = final.get("oks", {})
        res.samples = final.get("samples", [])
        if proc.returncode != 0 or res.tried < runs:
            tail = logfile.read_bytes()[-3000:].decode("utf-8", "replace")
            found = sorted(p.name for p in artifacts.iterdir())
            crash_input = (artifacts / found[0]).read_bytes() if found else b""
            res.crash(
                crash_input,
                f"atheris child exited with {proc.returncode} after {res.tried} of {runs} inputs "
                f"(process death, hang or out of memory); libFuzzer log tail:\n{tail}",
            )
    res.wall_s = time.perf_counter() - start
    return res


def _read_stats(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _atheris_child(target: str, runs: int, seed: int, stats_path: str, corpus_dir: str, artifacts: str) -> None:
    """Entry point of the atheris child. Never returns (libFuzzer exits the process)."""
    import traceback

    import atheris

    with atheris.instrument_imports(include=["schemas"]):
        from fuzzing import inputs as fuzzing

    one = fuzzing.PURE_TARGETS[target]
    corpus = Path(corpus_dir)
    corpus.mkdir(parents=True, exist_ok=True)
    for i, data in enumerate(fuzzing.corpus(target)):
        (corpus / f"seed-{i:03d}").write_bytes(data)
    res = FuzzResult(target, "atheris", runs)

    def write() -> None:
        tmp = Path(stats_path + ".tmp")
        tmp.write_text(json.dumps(res.as_dict()))
        os.replace(tmp, stats_path)

    def test_one_input(data: bytes) -> None:
        if res.tried >= runs:  # libFuzzer runs the whole seed corpus even when -runs is smaller
            return
        res.tried += 1
        try:
            res.count(*one(data))
        except Exception as err:
            res.crash(data, f"{type(err).__name__}: {err}\n{traceback.format_exc(limit=-4)}")
        if res.tried == runs or res.tried % 250 == 0:
            write()

    write()
    atheris.Setup(
        [
            sys.argv[0],
            f"-runs={runs}",
            f"-seed={seed % (2**31 - 2) + 1}",
            "-max_len=16384",
            "-timeout=30",
            "-rss_limit_mb=4096",
            f"-artifact_prefix={artifacts}/",
            "-print_final_stats=1",
            str(corpus),
        ],
        test_one_input,
    )
    atheris.Fuzz()


if (
    __name__ == "__main__"
):  # the atheris child: python -m fuzzing.engines atheris-child TARGET RUNS SEED STATS CORPUS ARTIFACTS
    if len(sys.argv) == 8 and sys.argv[1] == "atheris-child":
        _atheris_child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6], sys.argv[7])
    sys.exit("usage: python -m fuzzing.engines atheris-child TARGET RUNS SEED STATS CORPUS ARTIFACTS")
