"""The router r(x_t, t, y) -> K logits: which expert's partition does this noisy sample come from?

Trained with cross-entropy on the experts' own noising (t ~ U[0, 1], x_t = (1 - t) noise + t x, t = 0
noise, t = 1 data), so ``softmax(r)`` estimates p(partition k | x_t, t, y), the weights of the DDM
ensemble u = sum_k r_k v_k. The class label is optional: ``y = -1`` (or ``None`` in
:meth:`Router.weights`) means "unknown" and maps to a learned null embedding, which training uses
for a fraction of samples, so one network serves conditional and unconditional requests.

Checkpoint: ``<name>.safetensors`` (torch state_dict names, float32) + ``<name>.json``
(``format: ddm-fleet-router/1``, config, partition summary, training stats, accuracy vs t).
The expert format in ``models/checkpoint.py`` is tied to the expert configs, so the router has its own
format of the same two-file shape (paths and JSON reading shared: ``checkpoint_paths``, ``read_meta_json``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.checkpoint import checkpoint_paths, read_meta_json

FORMAT = "ddm-fleet-router/1"
TIME_CONVENTION = "t0_noise_t1_data"
UNKNOWN_CLASS = -1


class RouterError(ValueError):
    """Bad router input or a missing / malformed router checkpoint; the message says what."""


@dataclass(frozen=True)
class RouterConfig:
    """Architecture of :class:`RouterNet` (stored in the checkpoint JSON)."""

    num_experts: int = 2
    num_classes: int = 10
    width: int = 16  # channels of the first conv; the three stride-2 stages use 2w, 4w, 8w
    emb_dim: int = 64  # time + class embedding size
    image_size: int = 32
    in_channels: int = 1

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise RouterError(f"num_experts must be >= 1, got {self.num_experts}")
        if self.width < 8 or self.width % 8:
            raise RouterError(f"width must be a positive multiple of 8 (GroupNorm groups), got {self.width}")
        if self.image_size % 8:
            raise RouterError(f"image_size must be divisible by 8, got {self.image_size}")

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RouterConfig:
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise RouterError(f"unknown router config keys {sorted(unknown)}")
        return cls(**d)


def _build_net_class():
    """Define the torch module lazily, so importing this file does not import torch."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class _Stage(nn.Module):
        """conv3x3 (stride s) -> GroupNorm -> FiLM(cond) -> SiLU. [B, cin, H, W] -> [B, cout, H/s, W/s]."""

        def __init__(self, cin: int, cout: int, stride: int, emb_dim: int):
            super().__init__()
            self.conv = nn.Conv2d(cin, cout, 3, stride=stride, padding=1)
            self.norm = nn.GroupNorm(8, cout)
            self.film = nn.Linear(emb_dim, 2 * cout)

        def forward(self, h, c):
            scale, shift = self.film(c)[:, :, None, None].chunk(2, dim=1)
            return F.silu(self.norm(self.conv(h)) * (1 + scale) + shift)

    class RouterNet(nn.Module):
        """Small CNN router (~0.16M params at width 16, ~4M multiply-adds per image).

        forward(x_t [B, 1, 32, 32] float32, t [B] float32 in [0, 1], y [B] int64 with -1 = unknown)
        -> logits [B, K].
        """

        def __init__(self, num_experts: int = 2, cfg: RouterConfig | None = None, **kw):
            super().__init__()
            cfg = cfg or RouterConfig(num_experts=num_experts, **kw)
            self.cfg = cfg
            w, e = cfg.width, cfg.emb_dim
            self.time_fc1 = nn.Linear(e, e)
            self.time_fc2 = nn.Linear(e, e)
            self.class_emb = nn.Embedding(cfg.num_classes + 1, e)  # last row = unknown class
            self.conv_in = nn.Conv2d(cfg.in_channels, w, 3, padding=1)
            self.stages = nn.ModuleList(
                [
                    _Stage(w, 2 * w, 2, e),  # 16x16
                    _Stage(2 * w, 4 * w, 2, e),  # 8x8
                    _Stage(4 * w, 8 * w, 2, e),  # 4x4
                ]
            )
            self.head1 = nn.Linear(8 * w + e, 8 * w)
            self.head2 = nn.Linear(8 * w, cfg.num_experts)

        def time_embedding(self, t):
            """t [B] -> sinusoidal features [B, emb_dim] (t scaled to [0, 1000])."""
            half = self.cfg.emb_dim // 2
            freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
            ang = (t.float() * 1000.0)[:, None] * freqs[None, :]
            return torch.cat([torch.sin(ang), torch.cos(ang)], dim=1)

        def forward(self, x_t, t, y):
            y = torch.where(y < 0, torch.full_like(y, self.cfg.num_classes), y)
            c = self.time_fc2(F.silu(self.time_fc1(self.time_embedding(t)))) + self.class_emb(y)
            h = F.silu(self.conv_in(x_t))
            for stage in self.stages:
                h = stage(h, c)
            h = torch.cat([h.mean(dim=(2, 3)), c], dim=1)
            return self.head2(F.silu(self.head1(h)))

    return RouterNet


_NET_CLASS = None


def __getattr__(name: str):
    """``from models.router import RouterNet`` builds the torch class on first use."""
    global _NET_CLASS
    if name == "RouterNet":
        if _NET_CLASS is None:
            _NET_CLASS = _build_net_class()
        return _NET_CLASS
    raise AttributeError(name)


def num_params(net) -> int:
    return sum(p.numel() for p in net.parameters())


# --------------------------------------------------------------------------- checkpoint


def save_router(path: str | os.PathLike, net, meta: dict[str, Any]) -> Path:
    """Write ``<path>.safetensors`` + ``<path>.json`` for a RouterNet; returns the .safetensors path."""
    from safetensors.numpy import save_file

    st_path, json_path = checkpoint_paths(path)
    st_path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().cpu().contiguous().numpy() for k, v in net.state_dict().items()}
    tmp = st_path.with_name(st_path.name + f".tmp{os.getpid()}")
    save_file(state, str(tmp), metadata={"format": FORMAT})
    os.chmod(tmp, 0o644)
    os.replace(tmp, st_path)
    meta = dict(
        meta,
        format=FORMAT,
        config=net.cfg.to_dict(),
        time_convention=TIME_CONVENTION,
        num_params=num_params(net),
        weights_sha256=hashlib.sha256(st_path.read_bytes()).hexdigest(),
    )
    tmp = json_path.with_name(json_path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, json_path)
    return st_path


def load_router_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON half of a router checkpoint, validated."""
    st_path, json_path = checkpoint_paths(path)
    if not json_path.is_file():
        raise RouterError(f"router metadata {json_path} not found; train one with `ddm-fleet train-router`")
    meta = read_meta_json(json_path, FORMAT, "a router", RouterError)
    if meta.get("time_convention") != TIME_CONVENTION:
        raise RouterError(f"{json_path}: time convention {meta.get('time_convention')!r} is not {TIME_CONVENTION!r}")
    return meta


#: Rows per router forward pass: a larger batch is cut into pieces of this size. On a 2-core CPU the
#: shipped router weighs ~23k rows/s at 64 rows per pass against ~8k at 512 (big convolutions spill
#: the caches and allocate large temporaries, which also set the coordinator's peak memory).
ROUTER_CHUNK_ROWS = 64

#: torch intra-op threads of the router's forward pass, set in the calling thread only (with torch's
#: OpenMP backend the setting is per thread, so other threads of the process, e.g. an in-process
#: expert's, keep theirs). One thread: the router's small convolutions gain little from a second
#: one, and on a busy machine (the coordinator's event loop, its clients and workers on the other
#: cores) OpenMP's threads wait for each other: in a loaded spell on this 2-core box a 2-thread
#: forward of 64-row chunks took 0.4 - 1 s of CPU per 1000 rows against 0.07 - 0.13 s on one thread
#: (quiet, the two are within noise of each other per row).
#: The logits agree with the 2-thread ones to the last bits (equal at most batch sizes, ~1e-6 apart at
#: some): routing choices (top1, topk, oracle) are the same, as between batch sizes already.
ROUTER_THREADS = 1

_CHUNKS_CLASS = None


def _chunked_class():
    """A module that runs `net` over a batch `step` rows at a time and concatenates the logits.
    Scripted around the trace, one call from Python runs every chunk; called as it is, the same loop
    runs in Python (the eager network, or a torch that cannot script it). Defined once, at the first
    call, so importing this file does not import torch."""
    global _CHUNKS_CLASS
    if _CHUNKS_CLASS is None:
        _CHUNKS_CLASS = _define_chunks()
    return _CHUNKS_CLASS


def _define_chunks():
    import torch
    from torch import nn

    class _Chunks(nn.Module):
        def __init__(self, net, step: int):
            super().__init__()
            self.net = net
            self.step = step

        def forward(self, x, t, y):
            n = x.shape[0]
            if n <= self.step:
                return self.net(x, t, y)
            step = self.step
            return torch.cat([self.net(x[i : i + step], t[i : i + step], y[i : i + step]) for i in range(0, n, step)])

    return _Chunks


#: Whether `Router.load` runs the forward as frozen TorchScript: a trace of the network with the
#: chunk loop (`chunk_rows` rows per pass) scripted around it, built at the first call, checked
#: against the eager network on probe batches, eager if that fails or differs. Same bits as the
#: eager forward (checked for batch sizes 1-69, 100, 128, 129, 200, 256, 512, 513 and 1000 with the
#: shipped router), ~5% less CPU, and above all it keeps the router off the GIL. Each call into torch
#: from Python and each tensor freed from Python lets go of the GIL and must win it back; beside a
#: busy Python thread (the coordinator's event loop) every hand-back can wait a switch interval
#: (5 ms). The eager forward does that ~40 times per chunk: 64-row forwards per second went from
#: 4 (eager) to 30 (traced) beside a spinning Python thread. Tracing alone still left ~5 hand-backs
#: per 64-row chunk (the chunk's three input tensors, the call, its output); with the loop in the
#: graph a call has the same ~5 whatever its size: 512-row calls beside a spinning thread went from
#: 2,200 to 8,600 rows/s (15,600 alone), and one coordinator's capacity rose ~9% (2026-11-27).
ROUTER_TRACED = True


class Router:
    """A loaded router for inference (CPU, no grad). Use :meth:`load`, then :meth:`weights`.
    `chunk_rows`: most rows per forward pass (see ROUTER_CHUNK_ROWS). `threads`: torch intra-op
    threads in the thread that calls it (ROUTER_THREADS; None leaves torch's setting alone).
    `traced`: run `net` as frozen TorchScript (see ROUTER_TRACED; `load` turns it on), built at the
    first call with the `chunk_rows` of that moment (later changes to `chunk_rows` or to the network's
    modules are not seen); leave it off for a net still training."""

    #: the routing network's name, as a fleet's reported spec gives it (`arch`): every trained router is
    #: this module's network (format ddm-fleet-router/1), whatever spec its checkpoint stores
    arch = "router"

    def __init__(
        self,
        net,
        meta: dict[str, Any] | None = None,
        chunk_rows: int = ROUTER_CHUNK_ROWS,
        threads: int | None = ROUTER_THREADS,
        traced: bool = False,
    ):
        if chunk_rows < 1:
            raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {threads}")
        self.chunk_rows = chunk_rows
        self.threads = threads
        self.traced = bool(traced)
        self._graph = None  # the frozen trace, built at the first call when traced
        self._graph_lock = threading.Lock()
        self.net = net.eval()
        self.meta = meta or {}
        self.cfg: RouterConfig = net.cfg

    @property
    def num_experts(self) -> int:
        return self.cfg.num_experts

    @classmethod
    def load(cls, path: str | os.PathLike) -> Router:
        """Load ``<path>.safetensors`` + ``<path>.json`` (path may name either file or the stem)."""
        import torch
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        st_path, json_path = checkpoint_paths(path)
        meta = load_router_meta(path)
        if not st_path.is_file():
            raise RouterError(f"router weights {st_path} not found")
        digest = meta.get("weights_sha256")
        if digest and digest != hashlib.sha256(st_path.read_bytes()).hexdigest():
            raise RouterError(f"{st_path} does not match the sha256 in {json_path.name}: files from different saves")
        try:
            cfg = RouterConfig.from_dict(meta["config"])
            state = load_file(str(st_path))
        except (KeyError, TypeError) as exc:
            raise RouterError(f"{json_path}: bad config: {exc}") from None
        except (SafetensorError, OSError, ValueError) as exc:
            raise RouterError(f"{st_path}: cannot read safetensors: {exc}") from None
        net = __getattr__("RouterNet")(cfg=cfg)
        try:
            net.load_state_dict({k: torch.from_numpy(v.astype(np.float32)) for k, v in state.items()})
        except RuntimeError as exc:
            raise RouterError(f"{st_path}: weights do not match config {cfg.to_dict()}: {exc}") from None
        return cls(net, meta, traced=ROUTER_TRACED)

    def _forward_fn(self):
        """The callable that maps whole batches (x [B, C, H, W], t [B], y [B] torch tensors) to logits
        [B, K], `chunk_rows` rows per forward pass: the frozen TorchScript graph when `traced` (built
        here once), else the network in a Python loop."""
        if self.traced and self._graph is None:
            with self._graph_lock:
                if self._graph is None:
                    self._graph = self._build_graph()
        if self.traced and self._graph is not False:
            return self._graph
        return _chunked_class()(self.net, self.chunk_rows)

    def _build_graph(self):
        """The network as frozen TorchScript: traced, with the chunk loop scripted around the trace
        and both frozen (one call from Python runs every chunk: each call into torch and each tensor
        freed from Python lets go of the GIL and must win it back, see ROUTER_TRACED). Where the loop
        cannot be scripted (a torch without the source it compiles from), the frozen trace in a Python
        loop; False (the network eagerly) where tracing fails. A graph whose logits on probe batches
        (one chunk, and more than one) are not the eager network's bit for bit is not used."""
        import logging

        import torch

        log = logging.getLogger(__name__)
        c = self.cfg
        rng = np.random.default_rng(0)

        def probe(n: int):
            return (
                torch.from_numpy(
                    rng.standard_normal((n, c.in_channels, c.image_size, c.image_size)).astype(np.float32)
                ),
                torch.from_numpy(np.linspace(0.0, 1.0, n, dtype=np.float32)),
                torch.from_numpy(rng.integers(-1, c.num_classes, n).astype(np.int64)),
            )

        probes = [probe(5), probe(self.chunk_rows + 3)]
        eager = _chunked_class()(self.net.eval(), self.chunk_rows)

        def same(graph) -> bool:
            return all(torch.equal(graph(*p), eager(*p)) for p in probes)

        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's deprecation notes and a shape check traced as a constant
            try:
                traced = torch.jit.trace(self.net.eval(), probes[0], check_trace=False)
            except Exception as err:  # an exotic build of torch: the eager network does the same job
                log.warning("router: tracing failed (%s: %s); running it eagerly", type(err).__name__, err)
                return False
            try:
                graph = torch.jit.freeze(torch.jit.script(_chunked_class()(traced, self.chunk_rows)).eval())
                if same(graph):
                    return graph
                log.warning("router: the scripted chunk loop differs from the eager network; looping in Python")
            except Exception as err:
                log.warning(
                    "router: scripting the chunk loop failed (%s: %s); looping in Python", type(err).__name__, err
                )
            try:
                graph = _chunked_class()(torch.jit.freeze(traced), self.chunk_rows)
                if same(graph):
                    return graph
                log.warning("router: the traced network differs from the eager one; running it eagerly")
            except Exception as err:
                log.warning("router: freezing the trace failed (%s: %s); running it eagerly", type(err).__name__, err)
        return False

    def logits(self, x_t: np.ndarray, t: np.ndarray, y: np.ndarray | None = None) -> np.ndarray:
        """x_t float32 [B, 1, 32, 32], t [B] (or scalar) in [0, 1], y int [B] (-1 / None = unknown) -> [B, K]."""
        import torch

        x, tt, yy = self._check(x_t, t, y)
        before = torch.get_num_threads()
        if self.threads is not None and before != self.threads:
            torch.set_num_threads(self.threads)  # this thread's setting (see ROUTER_THREADS), for this call only:
        try:  # the thread may be a shared executor's that next runs an in-process expert with its own threads
            net = self._forward_fn()
            with torch.inference_mode():
                return net(torch.from_numpy(x), torch.from_numpy(tt), torch.from_numpy(yy)).numpy()
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)

    def weights(self, x_t: np.ndarray, t: np.ndarray, y: np.ndarray | None = None) -> np.ndarray:
        """Softmax routing weights, float32 [B, K], rows sum to 1."""
        z = self.logits(x_t, t, y).astype(np.float64)
        z -= z.max(axis=1, keepdims=True)
        p = np.exp(z)
        return (p / p.sum(axis=1, keepdims=True)).astype(np.float32)

    def _check(self, x_t, t, y) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        c = self.cfg
        x = np.asarray(x_t)
        want = (c.in_channels, c.image_size, c.image_size)
        if x.ndim != 4 or x.shape[1:] != want:
            raise RouterError(f"x_t must be [B, {want[0]}, {want[1]}, {want[2]}], got {list(x.shape)}")
        if x.dtype.kind != "f":
            raise RouterError(f"x_t must be floating point, got {x.dtype}")
        b = x.shape[0]
        tt = np.asarray(t, dtype=np.float32)
        if tt.ndim == 0:
            tt = np.full(b, float(tt), dtype=np.float32)
        if tt.shape != (b,):
            raise RouterError(f"t must be a scalar or [B={b}], got shape {list(tt.shape)}")
        if y is None:
            yy = np.full(b, UNKNOWN_CLASS, dtype=np.int64)
        else:
            ya = np.asarray(y)
            if ya.dtype.kind not in "iu":
                raise RouterError(f"y must be integer class labels (-1 = unknown), got {ya.dtype}")
            yy = ya.astype(np.int64)
            if yy.ndim == 0:
                yy = np.full(b, int(yy), dtype=np.int64)
            if yy.shape != (b,):
                raise RouterError(f"y must be a scalar or [B={b}], got shape {list(yy.shape)}")
            if b and (yy.min() < UNKNOWN_CLASS or yy.max() >= c.num_classes):
                raise RouterError(f"y must lie in -1..{c.num_classes - 1} (-1 = unknown)")
        if not (np.isfinite(x).all() and np.isfinite(tt).all()):
            raise RouterError("x_t and t must be finite")
        return np.ascontiguousarray(x, dtype=np.float32), tt, yy
