"""One fuzz target's tally (`FuzzResult`: ok / clear / crash counts, codes, crash samples) and its progress bar."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

MAX_SAMPLES = 8  # crash examples kept per target


@dataclasses.dataclass
class FuzzResult:
    target: str
    engine: str
    runs: int
    tried: int = 0
    ok: int = 0
    clear: int = 0
    crashes: int = 0
    unanswered: int = 0
    wall_s: float = 0.0
    check: str = ""  # the after-run liveness check (network targets)
    codes: dict = dataclasses.field(default_factory=dict)  # clear: error code -> count
    oks: dict = dataclasses.field(default_factory=dict)  # ok: what was served -> count
    samples: list = dataclasses.field(default_factory=list)  # first crashes: {"input", "len", "error"}

    def crash(self, data: Any, error: str) -> None:
        self.crashes += 1
        if len(self.samples) < MAX_SAMPLES:
            raw = data if isinstance(data, (bytes, bytearray)) else str(data).encode("utf-8", "replace")
            self.samples.append({"input": bytes(raw[:512]).hex(), "len": len(raw), "error": error[:2000]})

    def count(self, kind: str, detail: str = "") -> None:
        if kind == "ok":
            self.ok += 1
            self.oks[detail or "ok"] = self.oks.get(detail or "ok", 0) + 1
        elif kind == "clear":
            self.clear += 1
            self.codes[detail] = self.codes.get(detail, 0) + 1
        elif kind == "unanswered":
            self.unanswered += 1
        else:
            raise ValueError(kind)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["inputs_per_s"] = round(self.tried / self.wall_s, 1) if self.wall_s else 0.0
        return d


def progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(
        total=total,
        desc=f"fuzz {desc}",
        unit="in",
        file=sys.stderr,
        disable=not enabled,
        dynamic_ncols=True,
        mininterval=0.5,
    )
