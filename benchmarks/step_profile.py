"""Where a step's time goes, through the fleet and in-process (`ddm-fleet bench fleet --profile`).

The fleet's processes keep their own clocks and export them on /metrics; the bench scrapes the
coordinator and every worker before and after a level and divides the differences by the level's
ticks. At one client a tick is one step of one job and makes one expert call, so the split reads per step:

    client's step   = the level's wall time / (jobs x steps): what one user waits per step
    coordinator     = tick time - expert call: scheduling, routing not hidden behind a guessed call
                      (--speculate), the solver update, frames and events, event-loop wake-ups
    wire            = expert call (coordinator side) - worker receive-to-reply: msgpack in the
                      coordinator, two trips through nats-server, the processes' wake-ups
    worker          = receive-to-reply - forward: decoding, bucket padding, encoding the reply, and
                      waiting for the worker's previous forward when requests overlap
    forward         = the model's time inside the worker
    outside ticks   = client's step - tick time: submit, accept and done spread over the steps,
                      frames reaching the client

Running ahead (the coordinator's --run-ahead): most ticks then take a velocity the worker streamed
ahead instead of calling; `run_ahead_rows` per tick says how many. A worker's receive-to-reply time
covers only a request's first velocity while its forwards include the steps run ahead, so the wire and
the worker's own time are not split then; `forward` is still the model's time per tick.

With more clients a tick steps many jobs and calls its experts in parallel (and several ticks overlap,
--cohorts): the expert-call parts are then summed over a tick's calls and can exceed the tick, so the
coordinator's own share is not derived; the parts still compare fleet with in-process and call with forward.

Pure functions over scraped samples (tested without processes); `scrape` reads one /metrics page.
"""

from __future__ import annotations

#: metric -> short key. Histograms are read through their _sum and _count samples.
COORDINATOR_SERIES = {
    "ddm_coordinator_ticks_total": "ticks",
    "ddm_coordinator_tick_seconds_total": "tick_s",
    "ddm_coordinator_router_seconds_total": "router_s",
    "ddm_coordinator_expert_request_seconds_sum": "call_s",
    "ddm_coordinator_expert_request_seconds_count": "calls",
    "ddm_coordinator_rows_run_ahead_total": "ahead_rows",
}
WORKER_SERIES = {
    "ddm_worker_latency_seconds_sum": "latency_s",
    "ddm_worker_latency_seconds_count": "requests",
    "ddm_worker_forward_seconds_sum": "forward_s",
    "ddm_worker_forward_seconds_count": "forwards",
    # what the forwards computed (benchmarks.cpu_account: the rows and the mean batch of each expert)
    "ddm_worker_rows_total": "rows",
    "ddm_worker_padded_rows_total": "padded_rows",
    "ddm_worker_batches_total": "batches",
}


def parse_samples(text: str, series: dict[str, str]) -> dict[str, float]:
    """Sum the samples of each metric in `series` (over all label sets) from Prometheus text."""
    out = {key: 0.0 for key in series.values()}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if name in series:
            try:
                out[series[name]] += float(value)
            except ValueError:
                continue
    return out


def scrape(port: int, series: dict[str, str], host: str = "127.0.0.1", timeout: float = 10.0) -> dict | None:
    """One process's samples of `series` from http://host:port/metrics; None if it does not answer."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as r:
            return parse_samples(r.read().decode(), series)
    except OSError:
        return None


def delta(before: dict | None, after: dict | None) -> dict | None:
    if before is None or after is None:
        return None
    return {k: after[k] - before.get(k, 0.0) for k in after}


def summed(deltas: list[dict | None]) -> dict | None:
    """The workers' deltas added up (None if any worker could not be scraped)."""
    if not deltas or any(d is None for d in deltas):
        return None
    out: dict[str, float] = {}
    for d in deltas:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + v
    return out


def fleet_split(coord: dict | None, workers: dict | None, client_step_s: float | None) -> dict | None:
    """Milliseconds per tick of each part (module docstring), from the level's metric deltas.
    Parts that the counters cannot give (a process not scraped, no ticks) are left out."""
    if coord is None or coord.get("ticks", 0) <= 0:
        return None
    ticks = coord["ticks"]
    ms = {"ticks": int(ticks), "tick": 1000 * coord["tick_s"] / ticks, "router": 1000 * coord["router_s"] / ticks}
    ms["expert_call"] = 1000 * coord["call_s"] / ticks
    ms["calls_per_tick"] = coord["calls"] / ticks
    if ms["calls_per_tick"] <= 1.05:  # one call at a time: the tick is that call plus the coordinator's own work
        ms["coordinator"] = ms["tick"] - ms["expert_call"]
    ahead = coord.get("ahead_rows", 0.0)
    if ahead > 0:
        ms["run_ahead_rows"] = ahead / ticks
    if workers is not None and workers.get("requests", 0) > 0:
        ms["worker_requests_per_tick"] = workers["requests"] / ticks
        ms["forward"] = 1000 * workers["forward_s"] / ticks
        if ahead <= 0:  # else the worker's latency covers only first replies (module docstring)
            ms["worker"] = 1000 * (workers["latency_s"] - workers["forward_s"]) / ticks
            ms["wire"] = ms["expert_call"] - 1000 * workers["latency_s"] / ticks
    if client_step_s is not None:
        ms["client_step"] = 1000 * client_step_s
        ms["outside_ticks"] = ms["client_step"] - ms["tick"]
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in ms.items()}


def inprocess_split(ticks: int, tick_s: float, router_s: float, call_s: float, client_step_s: float | None) -> dict:
    """The in-process ceiling's split (its engine's counters; an expert call is a thread hop + forward)."""
    if ticks <= 0:
        return {}
    ms = {"ticks": int(ticks), "tick": 1000 * tick_s / ticks, "router": 1000 * router_s / ticks}
    ms["expert_call"] = 1000 * call_s / ticks
    if ms["expert_call"] <= ms["tick"]:  # one call at a time (see the module docstring)
        ms["coordinator"] = ms["tick"] - ms["expert_call"]
    if client_step_s is not None:
        ms["client_step"] = 1000 * client_step_s
        ms["outside_ticks"] = ms["client_step"] - ms["tick"]
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in ms.items()}


ROWS = (
    ("client_step", "step as one client sees it (level wall / steps run)"),
    ("outside_ticks", "  outside ticks (submit, accept, done, frames to the client)"),
    ("tick", "  tick (schedule -> solver update)"),
    ("coordinator", "    coordinator: schedule, route, update, events"),
    ("router", "      of which the router's forward (may overlap the call)"),
    ("expert_call", "    expert call"),
    ("run_ahead_rows", "      rows answered by running ahead (per tick; no call then)"),
    ("wire", "      wire: msgpack in the coordinator, 2 NATS trips, wake-ups"),
    ("worker", "      worker: decode, pad, encode, wait for its previous forward"),
    ("forward", "      forward"),
)


def format_split(concurrency: int, fleet: dict | None, ceiling: dict | None) -> list[str]:
    """Table lines: ms per tick, fleet beside in-process."""
    if not fleet and not ceiling:
        return []
    fleet, ceiling = fleet or {}, ceiling or {}
    ticks = f"{fleet.get('ticks', '-')} / {ceiling.get('ticks', '-')}"
    lines = [f"  where a tick's time goes at c = {concurrency} (ms per tick; ticks fleet / in-process: {ticks})"]
    if fleet.get("calls_per_tick", 1) > 1.05:
        lines[0] += f"; {fleet['calls_per_tick']:.2f} expert calls per tick, in parallel: call parts summed over them"
    lines.append(f"    {'':62} {'fleet':>8} {'in-proc':>8}")
    for key, label in ROWS:
        if key not in fleet and key not in ceiling:
            continue
        f = f"{fleet[key]:8.2f}" if key in fleet else f"{'-':>8}"
        c = f"{ceiling[key]:8.2f}" if key in ceiling else f"{'-':>8}"
        lines.append(f"    {label:62} {f} {c}")
    return lines
