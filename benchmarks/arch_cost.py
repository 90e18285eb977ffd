"""Forward cost of the expert architectures on this machine's CPU: DiT (hidden 128 / 192, depth 6, patch 2 / 4)
beside the UNet (widths 32,64,128 and 64,128,256), at 32x32 with 1 and 3 channels.

    PYTHONPATH=. python -m benchmarks.arch_cost [--threads 1] [--batch 64] [--rounds 6]

Per config: parameters, GFLOP per image (torch FlopCounterMode at batch 1, plus the attention matmuls,
4 T^2 D per block, which the counter does not see inside CPU scaled_dot_product_attention), and ms per
forward of --batch rows (torch fp32, inference_mode, weights jittered off the DiT's zero init). Configs run
round-robin for --rounds rounds, so a change in background load hits all of them alike; min and median.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bus.options import add_threads_option


def configs() -> list:
    from models.config import DiTConfig, UNetConfig

    rows: list = []
    for c in (1, 3):
        for d, heads in ((128, 4), (192, 6)):
            for p in (2, 4):
                rows.append(DiTConfig(in_channels=c, patch_size=p, hidden_size=d, depth=6, num_heads=heads))
        for w in ((32, 64, 128), (64, 128, 256)):
            rows.append(UNetConfig(in_channels=c, widths=w))
    return rows


def main(argv: list[str] | None = None) -> None:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from models.arch import build_torch
    from models.config import DiTConfig
    from models.dit_common import attention_flops

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_threads_option(ap, default=1)
    ap.add_argument("--batch", type=int, default=64, help="rows per forward (default 64)")
    ap.add_argument("--rounds", type=int, default=6, help="timed forwards per config, round-robin (default 6)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    runs = []
    for cfg in configs():
        model = build_torch(cfg).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        x = torch.randn(args.batch, cfg.in_channels, cfg.image_size, cfg.image_size)
        t, y = torch.rand(args.batch), torch.randint(0, cfg.num_classes, (args.batch,))
        with torch.inference_mode(), FlopCounterMode(display=False) as counter:
            model(x[:1], t[:1], y[:1])
        flops = counter.get_total_flops() + (attention_flops(cfg) if isinstance(cfg, DiTConfig) else 0)
        with torch.inference_mode():
            model(x, t, y)  # warm-up
        runs.append((cfg, model, (x, t, y), sum(p.numel() for p in model.parameters()), flops / 1e9, []))
    for _ in range(args.rounds):
        for _cfg, model, inputs, _, _, times in runs:
            with torch.inference_mode():
                start = time.perf_counter()
                model(*inputs)
                times.append((time.perf_counter() - start) * 1000)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), batch {args.batch}, {args.rounds} rounds")
    for cfg, _, _, n, gflop, times in runs:
        if isinstance(cfg, DiTConfig):
            name = f"DiT  C={cfg.in_channels} hidden={cfg.hidden_size} patch={cfg.patch_size} tokens={cfg.grid**2}"
        else:
            name = f"UNet C={cfg.in_channels} widths={','.join(map(str, cfg.widths))}"
        print(
            f"{name:44s} params {n / 1e6:5.2f}M  GFLOP/img {gflop:5.3f}  "
            f"min {min(times):6.0f}  median {statistics.median(times):6.0f} ms/{args.batch}"
        )


if __name__ == "__main__":
    main()
