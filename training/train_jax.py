"""Train one expert (UNet or DiT) with JAX/Flax on ONLY its partition's images (single device or data parallel).

Entry point: `train(args)` (called by `ddm-fleet train-expert --backend jax`). Same run definition as the
torch trainer (`training.train_torch.TrainConfig`, same flags, same data, same schedules, the same model
config from the data and `--arch`: `train_torch.model_config`, and the same spec in the checkpoint):

    batch x [B,C,S,S], y [B] from the expert's indices (shuffled each epoch, drop_last: static shapes)
    loss = flow-matching MSE (flow/path.py: x_t = (1-t) noise + t x, target v = x - noise)
    optax: clip_by_global_norm(grad_clip) -> AdamW(b1=0.9, b2=0.99) with warmup + cosine LR (`lr_at`)
    EMA of the params (what is saved), one jit-compiled step (loss, grads, update, EMA)

Data parallel: with several JAX devices (`--devices N`, default all that the default backend has) the step
runs SPMD over a 1-D `Mesh(devices, ("data",))`: params, optimizer state and EMA replicated
(`NamedSharding(mesh, P())`), the global batch split on its first axis (`P("data")`); XLA inserts the
gradient all-reduce. The result is the same step as on one device (up to float summation order), so
`--batch-size` is always the global batch. Try it on a CPU with
`XLA_FLAGS=--xla_force_host_platform_device_count=2`.

Every `--save-every` steps and at the end it writes the shipping checkpoint (`--out`, EMA weights under
torch state_dict names, models/checkpoint.py format: a torch or flax worker loads it alike) and a resume
file `<run-dir>/resume_jax.msgpack` (flax.serialization msgpack: params, optimizer state, EMA, step, loss
history, numpy RNG state), so an interrupted run is usable and `--resume` continues it.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from training.run_config import lr_at
from training.train_torch import (
    TrainConfig,
    arch_summary,
    check_resume_model,
    config_from_args,
    data_model,
    data_name,
    load_expert_data,
    model_config,
)

log = logging.getLogger(__name__)

RESUME_NAME = "resume_jax.msgpack"


class TrainState(NamedTuple):
    """Everything the jitted step carries (a pytree). step: int32 scalar array."""

    step: Any
    params: Any
    opt_state: Any
    ema: Any


def make_optimizer(cfg: TrainConfig):
    """optax part of the torch trainer's update: global-norm clip, then Adam moments (b1=0.9, b2=0.99).

    The learning rate (`lr_at(step)`, computed on the host like the torch trainer does) and the decoupled
    weight decay are applied in the step: p <- p - lr * (adam + weight_decay * p), which is torch AdamW.
    Keeping lr a step argument keeps the compiled step independent of --steps/--warmup/--lr.
    """
    import optax

    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), optax.scale_by_adam(b1=0.9, b2=0.99, eps=1e-8))


def mnist_model_config(cfg: TrainConfig):
    """The model config of `cfg` on MNIST (1x32x32, 10 classes): the default where none is given."""
    from training.datasets import MNIST_CLASSES, MNIST_SHAPE

    return model_config(cfg, MNIST_SHAPE, MNIST_CLASSES, cfg.label_dropout > 0)


def initial_params(cfg: TrainConfig, mcfg=None) -> dict:
    """Seeded initial weights: the torch model's init for `cfg.seed`, mapped 1:1 into the flax tree.
    mcfg: the UNetConfig / DiTConfig (default: `cfg` on MNIST).

    So `--seed S` starts the torch and the JAX trainer from the same weights, and no XLA compile is spent
    on the initialisers (on a CPU, compiling flax's `init` costs as much as compiling the train step).
    """
    import torch

    from models.arch import build_torch
    from models.checkpoint import torch_state_to_numpy, torch_to_flax_params

    ucfg = mnist_model_config(cfg) if mcfg is None else mcfg
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        state = torch_state_to_numpy(build_torch(ucfg).state_dict())
    return torch_to_flax_params(state, ucfg)


def init_state(cfg: TrainConfig, tx, mcfg=None) -> TrainState:
    """Fresh params (`initial_params`), optimizer state and EMA (= params) on the default device."""
    import jax
    import jax.numpy as jnp

    params = jax.tree_util.tree_map(jnp.asarray, initial_params(cfg, mcfg))
    ema = jax.tree_util.tree_map(jnp.copy, params)
    return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params), ema)


def flow_loss(model, params, x, y, key):
    """Flow-matching MSE of `model.apply(params, x_t, t, y)` on a data batch x [B,C,H,W], y [B] (scalar).

    noise ~ N(0, 1) and t ~ U[0, 1) are drawn from `key` for the GLOBAL batch shape, so the values do not
    depend on how the batch is sharded across devices.
    """
    import jax

    from flow.path import interpolate, mse, target_velocity

    k_noise, k_t = jax.random.split(key)
    noise = jax.random.normal(k_noise, x.shape, x.dtype)
    t = jax.random.uniform(k_t, (x.shape[0],), x.dtype)
    v_pred = model.apply({"params": params}, interpolate(x, noise, t), t, y)
    return mse(v_pred.astype("float32"), target_velocity(x, noise))


def make_step_fn(cfg: TrainConfig, tx, mcfg=None):
    """Un-jitted step `(state, x [B,C,H,W], y [B], key, lr) -> (state, loss)`: grads, AdamW update, EMA.
    mcfg: the UNetConfig / DiTConfig (default: `cfg` on MNIST)."""
    import jax
    import jax.numpy as jnp

    from models.arch_flax import build_flax

    model = build_flax(mnist_model_config(cfg) if mcfg is None else mcfg)
    wd, ema_max = cfg.weight_decay, cfg.ema_decay

    def step_fn(state: TrainState, x, y, key, lr):
        key = jax.random.fold_in(key, state.step)  # same noise for a step whatever the sharding / resume
        loss, grads = jax.value_and_grad(lambda p: flow_loss(model, p, x, y, key))(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = jax.tree_util.tree_map(lambda p, u: p - lr * (u + wd * p), state.params, updates)
        s = state.step.astype(jnp.float32)
        decay = jnp.minimum(ema_max, (1 + s) / (10 + s))  # == run_config.ema_decay_at(step, ema_decay)
        ema = jax.tree_util.tree_map(lambda e, p: e + (1 - decay) * (p - e), state.ema, params)
        return TrainState(state.step + 1, params, opt_state, ema), loss

    return step_fn


class Placement(NamedTuple):
    """Where arrays live: `devices` used, replicated / batch-split shardings (None on one device)."""

    devices: tuple
    replicated: Any
    batch: Any

    @property
    def n(self) -> int:
        return len(self.devices)


def make_placement(devices: int, batch_size: int) -> Placement:
    """Pick the first `devices` JAX devices (0 = all) and build the data-parallel mesh over them."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    avail = jax.devices()
    if devices < 0 or devices > len(avail):
        raise ValueError(
            f"--devices {devices}: JAX sees {len(avail)} {avail[0].platform} device(s) "
            f"(on a CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N makes N)"
        )
    use = tuple(avail[: devices or len(avail)])
    if batch_size % len(use):
        raise ValueError(
            f"--batch-size {batch_size} must be divisible by the {len(use)} devices used "
            f"(set --devices or the batch size)"
        )
    if len(use) == 1:
        return Placement(use, None, None)
    mesh = Mesh(np.array(use), ("data",))
    return Placement(use, NamedSharding(mesh, P()), NamedSharding(mesh, P("data")))


@functools.lru_cache(maxsize=8)
def _jitted_step(mcfg, weight_decay: float, ema_decay: float, grad_clip: float, place: Placement):
    """One jitted step per (model, update rule, placement): reused across runs in a process (no recompile).

    Several devices: state, key and lr replicated, x and y split on the batch axis, loss replicated.
    """
    import jax

    cfg = TrainConfig(expert=0, partition="", weight_decay=weight_decay, ema_decay=ema_decay, grad_clip=grad_clip)
    step_fn = make_step_fn(cfg, make_optimizer(cfg), mcfg)
    if place.n == 1:
        return jax.jit(step_fn, donate_argnums=0)
    r, b = place.replicated, place.batch
    return jax.jit(step_fn, in_shardings=(r, b, b, r, r), out_shardings=(r, r), donate_argnums=0)


def jit_step(cfg: TrainConfig, place: Placement, mcfg=None):
    """The compiled `(state, x, y, key, lr) -> (state, loss)` for this run's config (model config
    `mcfg`, default `cfg` on MNIST) and devices."""
    mcfg = mnist_model_config(cfg) if mcfg is None else mcfg
    return _jitted_step(mcfg, cfg.weight_decay, cfg.ema_decay, cfg.grad_clip, place)


def put_state(state, place: Placement):
    import jax

    return jax.device_put(state, place.replicated if place.n > 1 else place.devices[0])


def put_batch(x: np.ndarray, y: np.ndarray, place: Placement):
    import jax

    target = place.batch if place.n > 1 else place.devices[0]
    return jax.device_put(x, target), jax.device_put(y, target)


# ----------------------------------------------------------------------------------------------- resume
def save_resume(path: Path, state: TrainState, meta: dict) -> None:
    """msgpack (flax.serialization) of the state's arrays + a JSON string of the rest; atomic rename."""
    import jax
    from flax import serialization

    arrays = serialization.to_state_dict(jax.device_get(state._asdict()))
    blob = serialization.msgpack_serialize({"arrays": arrays, "meta": json.dumps(meta)})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(blob)
    tmp.replace(path)


def load_resume(path: Path, template: TrainState) -> tuple[TrainState, dict]:
    """Inverse of `save_resume`; `template` (a fresh state) gives the tree structure."""
    from flax import serialization

    if not path.exists():
        raise FileNotFoundError(f"--resume: {path} does not exist (start without --resume)")
    raw = serialization.msgpack_restore(path.read_bytes())
    meta = json.loads(raw["meta"])
    try:
        restored = serialization.from_state_dict(template._asdict(), raw["arrays"])
    except (ValueError, KeyError) as e:
        raise ValueError(f"--resume: {path} does not fit this model ({e})") from None
    return TrainState(**restored), meta


# ------------------------------------------------------------------------------------------------- loop
class _JaxRun:
    """One jax run's state (the jitted step's `TrainState`, numpy RNG, loss history, wall time): what
    `--resume` restores and every save writes, kept together so the loop, resume and save are each
    one short step."""

    def __init__(self, cfg: TrainConfig, ucfg, spec, partition_info: dict, place: Placement):
        self.cfg, self.ucfg, self.spec, self.partition_info, self.place = cfg, ucfg, spec, partition_info, place
        from models.arch_flax import count_params

        self.state = init_state(cfg, make_optimizer(cfg), ucfg)
        self.n_params = count_params(self.state.params)
        self.resume_path = Path(cfg.run_dir) / RESUME_NAME
        self.wall_before, self.history = 0.0, []
        self.rng = np.random.default_rng(cfg.seed)
        self.t_start = time.time()

    def restore(self) -> None:
        """Continue from the resume file; refused when it holds another expert or model."""
        cfg, path = self.cfg, self.resume_path
        self.state, rmeta = load_resume(path, self.state)
        if tuple(rmeta["widths"]) != tuple(cfg.widths) or rmeta["expert"] != cfg.expert:
            raise ValueError(
                f"--resume: {path} is for expert {rmeta['expert']} widths {rmeta['widths']}, "
                f"not expert {cfg.expert} widths {list(cfg.widths)}"
            )
        check_resume_model(rmeta, self.ucfg, path)
        self.wall_before, self.history = rmeta["wall_s"], rmeta["history"]
        self.rng.bit_generator.state = rmeta["np_rng"]
        log.info("resumed from %s at step %d", path, int(self.state.step))

    def stats(self, final: bool, step: int) -> dict:
        """The training stats the checkpoint JSON carries."""
        import jax

        cfg, place, recent = self.cfg, self.place, [h["loss"] for h in self.history[-5:]]
        return {
            "backend": "jax",
            "device": f"{place.devices[0].platform} x{place.n}",
            "data_parallel": place.n,
            "steps": step,
            "images_seen": step * cfg.batch_size,
            "wall_s": round(self.wall_before + (time.time() - self.t_start), 1),
            "final_loss": round(float(np.mean(recent)), 5) if recent else None,
            "loss_history": self.history,
            "complete": final and step >= cfg.steps,
            "params": self.n_params,
            "jax": jax.__version__,
            "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
        }

    def save(self, final: bool, step: int) -> dict:
        """The shipping checkpoint (EMA weights under torch names) and the resume file; the stats."""
        import jax

        from models.checkpoint import flax_to_torch_state, save_checkpoint
        from models.spec import with_spec

        cfg, ucfg = self.cfg, self.ucfg
        stats = self.stats(final, step)
        host = jax.device_get(self.state)
        meta = {
            "config": ucfg,
            "expert_id": cfg.expert,
            "partition": self.partition_info,
            "training": stats,
            "weights": "ema",
        }
        save_checkpoint(cfg.out, flax_to_torch_state(host.ema), with_spec(meta, self.spec), dtype=cfg.save_dtype)
        resume_meta = {
            "step": step,
            "wall_s": stats["wall_s"],
            "history": self.history,
            "np_rng": self.rng.bit_generator.state,
            "widths": list(cfg.widths),
            "expert": cfg.expert,
            "arch": cfg.arch,
            "model_config": ucfg.to_dict(),
        }
        save_resume(self.resume_path, host, resume_meta)
        return stats


def _train_steps(run: _JaxRun, images: np.ndarray, labels: np.ndarray, progress: bool) -> dict:
    """Step from the state's step to `cfg.steps`, saving every `save_every` steps and at the end (the
    final stats). Each loss is read back one step late, after the next step is dispatched, so the
    device is kept busy."""
    import jax

    from training.progress import TrainProgress

    cfg, place = run.cfg, run.place
    step = int(run.state.step)
    run.state = put_state(run.state, place)
    train_step = jit_step(cfg, place, run.ucfg)
    base_key = jax.random.PRNGKey(cfg.seed + 1)
    n = len(images)
    per_epoch = n // cfg.batch_size  # drop_last: every batch has the same static shape
    labels = labels.astype(np.int32)
    perm, pos = run.rng.permutation(n), 0
    desc = f"expert{cfg.expert} jax x{place.n}"
    prog = TrainProgress(cfg, run.history, step=step, desc=desc, progress=progress, main=True, hint="lower --lr")
    run.t_start = time.time()
    pending = None  # the previous step's (loss, step), read after the next step is dispatched

    def account(loss_arr, at_step: int) -> None:
        prog.add(float(loss_arr), at_step)
        prog.advance()
        prog.report(at_step)

    while step < cfg.steps:
        if pos + cfg.batch_size > per_epoch * cfg.batch_size:
            perm, pos = run.rng.permutation(n), 0
        idx = perm[pos : pos + cfg.batch_size]
        pos += cfg.batch_size
        x, y = put_batch(images[idx], labels[idx], place)
        run.state, loss = train_step(run.state, x, y, base_key, np.float32(lr_at(step, cfg)))
        step += 1
        if pending is not None:
            account(*pending)
        pending = (loss, step)
        if step % cfg.save_every == 0 and step < cfg.steps:
            account(*pending)
            pending = None
            run.save(final=False, step=step)
    if pending is not None:
        account(*pending)
    prog.close()
    return run.save(final=True, step=step)


def train_expert(
    cfg: TrainConfig,
    images: np.ndarray,
    labels: np.ndarray,
    partition_info: dict,
    resume: bool = False,
    progress: bool = True,
    devices: int = 0,
) -> dict:
    """Run the training loop; returns the training stats written into the checkpoint JSON.

    images float32 [N,C,S,S] in [-1,1], labels int64 [N] (-1 = unlabelled): the expert's own data only;
    partition_info["dataset"] (when present) names the prepared dataset (else MNIST).
    devices: how many JAX devices to train on data-parallel (0 = all of the default backend's).
    """
    if cfg.label_dropout > 0:
        raise ValueError(
            "--label-dropout (null label for unconditional generation) is in the torch trainer only "
            "so far; use --backend torch"
        )
    place = make_placement(devices, cfg.batch_size)
    ucfg, spec = data_model(cfg, partition_info)
    if tuple(images.shape[1:]) != tuple(spec.sample_shape):
        raise ValueError(f"images are {list(images.shape[1:])} but the data's spec says {list(spec.sample_shape)}")
    run = _JaxRun(cfg, ucfg, spec, partition_info, place)
    if resume:
        run.restore()
    return _train_steps(run, images, labels, progress)


def train(args: argparse.Namespace) -> int:
    """CLI entry for `ddm-fleet train-expert --backend jax`."""
    import jax

    cfg = config_from_args(args)
    devices = int(getattr(args, "devices", 0) or 0)
    if cfg.device != "cpu":
        log.warning(
            "--device %s is for the torch backend; jax trains on its default platform (%s), "
            "choose it with JAX_PLATFORMS",
            cfg.device,
            jax.default_backend(),
        )
    if cfg.bf16:
        log.warning("--dtype %s (bfloat16 here) is ignored by the jax backend (fp32 training)", args.dtype)
    images, labels, info = load_expert_data(cfg)
    n_dev = devices or jax.device_count()
    print(
        f"expert {cfg.expert}: {info['num_images']} images of {data_name(info)}, classes {info['classes']}, "
        f"jax {jax.default_backend()} x{n_dev} data-parallel, {arch_summary(cfg)}, "
        f"{cfg.steps} steps x batch {cfg.batch_size}",
        flush=True,
    )
    stats = train_expert(cfg, images, labels, info, resume=args.resume, progress=not args.no_progress, devices=devices)
    print(
        f"saved {cfg.out}.safetensors: {stats['steps']} steps, final loss {stats['final_loss']}, {stats['wall_s']} s",
        flush=True,
    )
    return 0
