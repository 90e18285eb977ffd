"""CPU per image: what a fleet spends beside its experts' own forwards (`ddm-fleet bench fleet`).

Wall-clock ratios swing with the box's load; CPU time per image does not. For each level the bench
reads every fleet process's user + system CPU seconds (/proc/<pid>/stat) before and after, and the
workers' row and batch counters (/metrics). Here:

    fleet CPU per image    = (coordinator + workers + nats-server + decoder CPU seconds) / images made;
                             the clients (the bench process) are shown apart: a user's clients run elsewhere
    forward CPU per image  = sum over experts of (rows the expert's workers computed x the expert's own forward
                             CPU seconds per row at the level's mean batch) / images, where the CPU per row at
                             each batch size was timed in the bench process before the fleet started (the
                             forward-only limit: the backend the workers use, one thread per forward on a CPU)
    overhead factor        = fleet CPU per image / forward CPU per image: 1.0 would be a fleet that spends
                             nothing but the forwards; what it spends above is decoding, padding, executor
                             hops, encoding, routing, the solver, events and nats-server's copies
    decoder share          = the decoder process's CPU seconds / the fleet's (a latent fleet's; absent for a
                             pixel fleet, which has no decoder): what turning latents into images costs
    cores busy             = every process's CPU seconds (the clients' too) / the level's wall seconds
    reach at full cores    = (cores / CPU seconds per image, the clients' included) / the forward-only limit's
                             images/s: the fraction of the limit this CPU per image allows with every core
                             busy; what the level made below it, the fleet's processes left cores idle (or
                             other load took them). "workers alone": the same with only the workers' CPU
                             per image (and a latent fleet's decoder's: its images need it), what the host
                             would reach with the coordinator, nats-server and the clients on other cores.
                             Only where the limit was timed on CPU cores (one thread per core): a device's
                             forward is not the host's CPU

A worker's padded rows count in its mean batch (they were computed) but not in the forward's rows (they
make no image): padding is overhead. Pure functions over the bench's samples, tested without processes.
"""

from __future__ import annotations

import math

#: what each of the bench's process names is, for the per-role split (workers "worker0", "worker1.2", ...)
ROLES = ("coordinator", "workers", "nats-server", "decoder")
CLIENTS = "clients"
DECODER = "decoder"


def role_of(process: str) -> str:
    """The role of a bench process name: coordinator, workers, nats-server, decoder or clients."""
    if process.startswith("worker"):
        return "workers"
    if process in ("coordinator", "nats-server", "decoder"):
        return process
    return CLIENTS


def at_batch(by_batch: dict, batch: float) -> float | None:
    """A per-batch figure (seconds per row, rows/s) at `batch` from {batch: value} (keys may be strings, as
    in JSON): log-linear in the batch between the timed sizes, clamped to the smallest and the largest;
    None if empty."""
    table = sorted((int(b), float(s)) for b, s in by_batch.items())
    if not table:
        return None
    b = min(max(batch, table[0][0]), table[-1][0])
    for (b0, s0), (b1, s1) in zip(table, table[1:]):
        if b0 <= b <= b1:
            f = 0.0 if b1 == b0 else (math.log2(b) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
            return s0 + f * (s1 - s0)
    return table[0][1]  # a single timed size


def worker_rows(deltas: list[dict | None], experts: list[int]) -> dict[int, dict] | None:
    """Per expert, what its workers computed in the level, from each worker's counter deltas
    ({"rows", "padded_rows", "batches"}) and the expert each worker serves: {expert: {"rows",
    "padded_rows", "batches", "mean_batch"}}; None when a worker could not be scraped."""
    if not deltas or any(d is None for d in deltas):
        return None
    out: dict[int, dict] = {}
    for d, k in zip(deltas, experts):
        e = out.setdefault(int(k), {"rows": 0.0, "padded_rows": 0.0, "batches": 0.0})
        for key in e:
            e[key] += float(d.get(key, 0.0))
    for e in out.values():
        e["mean_batch"] = round((e["rows"] + e["padded_rows"]) / e["batches"], 2) if e["batches"] else None
        for key in ("rows", "padded_rows", "batches"):
            e[key] = int(e[key])
    return out


def account(
    cpu_seconds: dict[str, float | None],
    images: int,
    steps: int,
    rows: dict | None,
    limit: dict | None,
    wall_s: float | None = None,
) -> dict:
    """The level's CPU account (module docstring). `cpu_seconds`: {process name: CPU seconds in the level};
    `rows`: `worker_rows` (None: unknown, no forward figure); `limit`: the forward-only limit with each
    expert's "cpu_s_per_row_by_batch" (None: not timed). Milliseconds per image, and per image and step
    (`steps`: denoising steps per image), so c = 1 reads per step; with a decoder process, its share of the
    fleet's CPU seconds ("decoder_share", 0 - 1); with the level's `wall_s`, the cores it kept busy; with
    a limit timed on cores, the reach at full cores (`_reach`)."""
    if images <= 0:
        return {"images": 0}
    by_role: dict[str, float] = {}
    missing = []
    for name, s in cpu_seconds.items():
        if s is None:
            missing.append(name)
            continue
        by_role[role_of(name)] = by_role.get(role_of(name), 0.0) + s
    fleet_s = sum(v for r, v in by_role.items() if r != CLIENTS)
    out: dict = {
        "images": int(images),
        "fleet_ms_per_image": round(1000 * fleet_s / images, 3),
        "by_role_ms_per_image": {r: round(1000 * by_role[r] / images, 3) for r in (*ROLES, CLIENTS) if r in by_role},
        "fleet_ms_per_image_step": round(1000 * fleet_s / (images * steps), 4),
    }
    if DECODER in by_role and fleet_s > 0:
        out["decoder_share"] = round(by_role[DECODER] / fleet_s, 4)
    if missing:
        out["processes_unread"] = missing  # gone before the level ended: the figures leave them out
    forward_s = _forward_seconds(rows, limit)
    if forward_s is not None and forward_s > 0:
        out["forward_ms_per_image"] = round(1000 * forward_s / images, 3)
        out["forward_ms_per_image_step"] = round(1000 * forward_s / (images * steps), 4)
        out["overhead_factor"] = round(fleet_s / forward_s, 3)
        out["overhead_ms_per_image_step"] = round(1000 * (fleet_s - forward_s) / (images * steps), 4)
    if rows is not None:
        out["mean_batch"] = {str(k): e["mean_batch"] for k, e in sorted(rows.items())}
    if not missing:  # every process read: the whole box's share of the work is known
        if wall_s and wall_s > 0:
            out["cores_busy"] = round(sum(by_role.values()) / wall_s, 3)
        out.update(_reach(by_role, images, limit))
    return out


def _reach(by_role: dict[str, float], images: int, limit: dict | None) -> dict:
    """{"full_cores_over_limit", "workers_alone_over_limit"} (module docstring), or {} where the limit was
    not timed on CPU cores or nothing was spent."""
    if not limit or limit.get("unit") != "core" or not limit.get("images_per_s") or not limit.get("units"):
        return {}
    out = {}
    for key, seconds in (
        ("full_cores_over_limit", sum(by_role.values())),
        ("workers_alone_over_limit", by_role.get("workers", 0.0) + by_role.get(DECODER, 0.0)),
    ):
        if seconds > 0:
            out[key] = round(limit["units"] * images / seconds / limit["images_per_s"], 3)
    return out


def _forward_seconds(rows: dict | None, limit: dict | None) -> float | None:
    """The experts' own forward CPU seconds for the rows the level computed, at its mean batch sizes."""
    if rows is None or limit is None:
        return None
    total = 0.0
    for k, e in rows.items():
        if e["rows"] == 0:
            continue
        if k >= len(limit["experts"]) or e["mean_batch"] is None:
            return None
        per_row = at_batch(limit["experts"][k].get("cpu_s_per_row_by_batch") or {}, e["mean_batch"])
        if per_row is None:
            return None
        total += e["rows"] * per_row
    return total


def format_account(concurrency: int, acc: dict) -> str:
    """One report line of a level's account."""
    if not acc.get("images"):
        return f"conc {concurrency}: no images"
    roles = ", ".join(f"{r} {v:.2f}" for r, v in acc["by_role_ms_per_image"].items() if r != CLIENTS)
    line = f"conc {concurrency}: fleet {acc['fleet_ms_per_image']:.2f} ms/img ({roles})"
    if "decoder_share" in acc:
        line += f", decoder share {100 * acc['decoder_share']:.1f}%"
    if "forward_ms_per_image" in acc:
        batches = ", ".join(f"expert{k} {b}" for k, b in acc.get("mean_batch", {}).items())
        line += (
            f", forward {acc['forward_ms_per_image']:.2f} ms/img at mean batch {batches}: overhead x"
            f"{acc['overhead_factor']:.2f}, {acc['overhead_ms_per_image_step']:.3f} ms per image-step above the forward"
        )
    if CLIENTS in acc["by_role_ms_per_image"]:
        line += f"; clients {acc['by_role_ms_per_image'][CLIENTS]:.2f} ms/img apart"
    if "cores_busy" in acc:
        line += f"; {acc['cores_busy']:.2f} cores busy"
    if "full_cores_over_limit" in acc:
        line += f"; every core busy at this CPU per image: {acc['full_cores_over_limit']:.2f} of the limit"
        if "workers_alone_over_limit" in acc:
            who = "the workers and the decoder" if "decoder_share" in acc else "the workers"
            line += f" ({acc['workers_alone_over_limit']:.2f} with only {who} on the cores)"
    return line
