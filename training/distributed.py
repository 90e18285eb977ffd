"""Torch data parallelism for one expert on an island of several devices (torchrun + DDP).

Launch the ordinary command under torchrun; nothing else changes:

    torchrun --standalone --nproc_per_node 2 -m infra.cli train-expert --expert 0 ... --backend torch

torchrun sets WORLD_SIZE / RANK / LOCAL_RANK / MASTER_ADDR / MASTER_PORT in each process. `detect()` reads
them; the trainer then

* `init(info, device)`: `init_process_group` with gloo on CPU, nccl on CUDA (each rank on
  `cuda:<LOCAL_RANK>`);
* wraps the model in `DistributedDataParallel` (`wrap`), which broadcasts rank 0's weights at construction
  and all-reduces (averages) gradients in backward, so every rank takes the identical optimizer step;
* draws each GLOBAL batch of `--batch-size` indices from the same seeded permutation on every rank and
  keeps its own disjoint slice (`shard`): rank r of W gets rows [r*B/W, (r+1)*B/W), so a step sees the
  same images as a single-process run with the same seed;
* gives each rank its own noise stream (`rank_seed`), so ranks do not draw the same noise for their rows;
* writes checkpoints, the resume file, logs and the progress bar on rank 0 only (`info.is_main`), and
  checks at the end that every rank holds bit-identical weights (`param_digests`).

torch_xla (Trainium) islands use their own launcher (torch_neuronx / xla multiprocessing) and are not
handled here.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job. world_size 1 = plain single-process training."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(env, name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise RuntimeError(f"${name}={raw!r} is not an integer (set by torchrun; do not set it by hand)") from None


def detect(env=None) -> DistInfo:
    """Read torchrun's WORLD_SIZE / RANK / LOCAL_RANK (absent: a single process)."""
    env = os.environ if env is None else env
    world = _env_int(env, "WORLD_SIZE", 1)
    rank = _env_int(env, "RANK", 0)
    local = _env_int(env, "LOCAL_RANK", rank)
    if world < 1 or not 0 <= rank < world or local < 0:
        raise RuntimeError(f"bad torchrun environment: WORLD_SIZE={world} RANK={rank} LOCAL_RANK={local}")
    return DistInfo(world, rank, local)


def local_device(info: DistInfo, device: str) -> str:
    """The device this rank trains on: 'cuda' -> 'cuda:<LOCAL_RANK>' under DDP; cpu stays cpu."""
    if info.enabled and device == "cuda":
        return f"cuda:{info.local_rank}"
    return device


def init(info: DistInfo, device: str) -> str:
    """Join the process group (gloo for CPU, nccl for CUDA); returns the backend name. No-op for 1 process."""
    import torch
    import torch.distributed as dist

    if not info.enabled:
        return ""
    if device == "xla":
        raise RuntimeError(
            "torchrun data parallel supports --device cpu or cuda; torch_xla islands need their own launcher"
        )
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, rank=info.rank, world_size=info.world_size)
    return backend


def wrap(model, info: DistInfo, device: str):
    """DistributedDataParallel(model) under torchrun, else the model itself."""
    if not info.enabled:
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [info.local_rank] if device.startswith("cuda") else None
    return DDP(model, device_ids=ids, broadcast_buffers=False)


def check_batch(batch_size: int, info: DistInfo) -> int:
    """Rows per rank; the global --batch-size must split evenly."""
    if batch_size % info.world_size:
        raise ValueError(f"--batch-size {batch_size} must be divisible by the {info.world_size} torchrun processes")
    return batch_size // info.world_size


def shard(global_idx: np.ndarray, info: DistInfo) -> np.ndarray:
    """This rank's contiguous slice of one global batch of indices (disjoint across ranks, same for a step)."""
    per = check_batch(len(global_idx), info)
    return global_idx[info.rank * per : (info.rank + 1) * per]


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """Seed of rank `rank`'s noise stream at (resumed) step `step`; differs across ranks and resumes."""
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])


def mean_across(value: float, info: DistInfo, device) -> float:
    """Average a python float over all ranks (the global batch's loss); identity for 1 process."""
    if not info.enabled:
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item()) / info.world_size


def param_digests(params, info: DistInfo) -> list[str]:
    """sha256 of this rank's parameters, gathered from every rank (rank order). One entry for 1 process."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    mine = h.hexdigest()[:16]
    if not info.enabled:
        return [mine]
    import torch.distributed as dist

    out: list = [None] * info.world_size
    dist.all_gather_object(out, mine)
    return out


def barrier(info: DistInfo) -> None:
    if info.enabled:
        import torch.distributed as dist

        dist.barrier()


def shutdown(info: DistInfo) -> None:
    """Leave the process group (call once, at the end, on every rank)."""
    if info.enabled:
        import torch.distributed as dist

        if dist.is_initialized():
            # Every rank reaches teardown before any leaves: a rank that exits while another still
            # has gloo work in flight can abort ("terminate called without an active exception").
            dist.barrier()
            dist.destroy_process_group()
