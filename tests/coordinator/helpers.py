"""The tiny fleet the coordinator-level tests share, built with the one factory `models.tiny`.

Coordinator, system and CLI tests want experts that differ visibly (strategies pick between
them), so these use three levels (8, 16, 32) and ``jitter=0.05`` on top of the factory's seeded
random init; the fixtures in tests/coordinator/conftest.py wrap them.
"""

from __future__ import annotations

from pathlib import Path

from models.tiny import make_tiny_dit, make_tiny_expert
from models.tiny import make_tiny_experts as _factory_experts
from models.tiny import make_tiny_router as _factory_router

TINY_WIDTHS = (8, 16, 32)
JITTER = 0.05

__all__ = [
    "TINY_WIDTHS",
    "JITTER",
    "make_tiny_expert",
    "make_tiny_experts",
    "make_tiny_dits",
    "make_tiny_router",
    "start_workers",
    "stop_workers",
    "run_ahead_discovered",
]


def make_tiny_experts(directory: Path, num_experts: int = 2) -> list[Path]:
    """``num_experts`` tiny experts ``<directory>/expert<k>`` (widths 8,16,32, GroupNorm 8,
    jitter 0.05, classes dealt out 0-4 | 5-9); returns their ``.safetensors`` paths."""
    return _factory_experts(directory, num_experts, widths=TINY_WIDTHS, jitter=JITTER, groups=8)


def make_tiny_router(path: Path, num_experts: int = 2) -> Path:
    """A random-init RouterNet (width 8, emb 16, seed 5) in the shipped router format."""
    return _factory_router(path, num_experts, meta={"test": True})


def make_tiny_dits(directory: Path, num_experts: int = 2) -> list[Path]:
    """``num_experts`` tiny DiT experts ``<directory>/expert<k>`` (``models.tiny.make_tiny_dit``: 8x8 tokens,
    width 32, two blocks, jitter 0.05), classes dealt out as `make_tiny_experts` does (0-4 | 5-9)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return [
        make_tiny_dit(
            directory / f"expert{k}",
            expert_id=k,
            classes=list(range(10 * k // num_experts, 10 * (k + 1) // num_experts)),
        )
        for k in range(num_experts)
    ]


def make_tiny_fleet_experts(directory: Path, arch: str = "unet", num_experts: int = 2) -> list[Path]:
    """Tiny experts of `arch` ("unet": `make_tiny_experts`, "dit": `make_tiny_dits`) for fleet tests
    parametrized over the architecture."""
    if arch == "dit":
        return make_tiny_dits(directory, num_experts)
    if arch != "unet":
        raise ValueError(f"arch must be unet or dit, got {arch!r}")
    return make_tiny_experts(directory, num_experts)


async def start_workers(
    nats_url: str, paths, *, buckets=(1, 4, 16), dtype: str | None = None, per_expert: int = 1, **options
) -> list:
    """Real `ExpertWorker`s in this process, `per_expert` for each checkpoint (expert k = paths[k]),
    started in order; `dtype` None leaves the worker's default (auto); `options`: more `WorkerConfig`
    fields (`batch_quantum=16`, ...). Stop them with `stop_workers`."""
    from workers.service import ExpertWorker

    kw = dict(options) if dtype is None else {"dtype": dtype, **options}
    ws = []
    try:
        for k, path in enumerate(paths):
            for _ in range(per_expert):
                ws.append(ExpertWorker(expert=k, checkpoint=path, nats_url=nats_url, buckets=tuple(buckets), **kw))
                await ws[-1].start()
    except BaseException:
        await stop_workers(ws)
        raise
    return ws


async def stop_workers(ws) -> None:
    for w in ws:
        await w.stop()


async def run_ahead_discovered(transport, want: dict) -> None:
    """Discover the workers until the transport knows each expert's run-ahead steps to be `want` (what the
    workers advertise is learned at discovery; a loaded box may miss a worker's answer in one round)."""
    from tests.waiting import wait_until

    async def known():
        await transport.refresh_workers()
        return transport.run_ahead_of == want

    await wait_until(known, timeout=20, interval=0.1, what=f"run_ahead_of == {want}")
