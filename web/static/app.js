// ddm-fleet web viewer. Plain JS, no build step. Protocol: web/protocol.py.
"use strict";

const PALETTE = ["#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6", "#bfef45",
                 "#fabed4", "#469990", "#dcbeff", "#9a6324"];
const MIXED = "#9aa0aa";
// A label of -1 is "no digit" / "label unknown" (an unconditional image; the router alone picks the experts).
const NO_DIGIT = -1;
const NO_DIGIT_TITLE = "no digit: label unknown (unconditional), the router alone picked the experts";
const NO_LABEL_TITLE = "label unknown (unconditional), the router alone picked the experts";
// The fleet's model spec (the server's `spec` message, web/spec.py); until it comes, the MNIST fleet's.
const MNIST_SPEC = { known: false, sample_shape: [1, 32, 32], channels: 1, size: [32, 32], tile_channels: 1,
                     conditioning: "class", num_classes: 10, null_label: false, digits: true,
                     class_names: ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"] };
const DEFAULT_DIGITS = "0,1,2,3,4,5,6,7,8,9";
const fleetSpec = () => state.spec || MNIST_SPEC;
// A label as the page shows it: its class name ("?" when unknown); on the MNIST fleet "digit 3".
const labelName = (l) => (l === NO_DIGIT ? "?" : (fleetSpec().class_names[l] ?? String(l)));
const labelText = (l) => (fleetSpec().digits ? `digit ${labelName(l)}` : labelName(l));
const unknownTitle = () => (fleetSpec().digits ? NO_DIGIT_TITLE : NO_LABEL_TITLE);
// A label in a file name: digit3 / nodigit on the MNIST fleet, else the class name made file-safe / nolabel.
function labelFile(l) {
  if (fleetSpec().digits) return l === NO_DIGIT ? "nodigit" : `digit${l}`;
  return l === NO_DIGIT ? "nolabel" : labelName(l).replace(/[^A-Za-z0-9_-]+/g, "_").slice(0, 40);
}
const expertColor = (e) => (e === null || e === undefined || e < 0) ? MIXED : PALETTE[e % PALETTE.length];

const $ = (sel, root = document) => root.querySelector(sel);
const el = (tag, attrs = {}, ...children) => {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k === "text") node.textContent = v;
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c);
  return node;
};

const state = {
  ws: null,
  jobs: new Map(),      // job_id -> {card, tiles, traj (kept frames), timeline, ...}; see jobCard
  pending: new Map(),   // ref -> request summary, until accepted / rejected
  nextRef: 1,
  retryMs: 500,
  token: null,          // the viewer's token, when it needs one (URL fragment #token=...)
  experts: 0,           // K, learned from weights and the fleet panel
  dirty: new Set(),     // jobs with a live frame to draw at the next animation frame
  drawPending: false,
  history: [],          // fleet snapshots of the last HISTORY_S seconds (sparklines)
  stats: { frames: 0, handleMs: 0, keptBytes: 0 },  // frames handled, time in the frame handler
};

// ------------------------------------------------------------------ socket

// A viewer exposed beyond loopback needs a token: open it as http://host:port/#token=...  The token is
// kept for this tab (sessionStorage), removed from the address bar, and offered as a websocket subprotocol.
function viewerToken() {
  const m = /(?:^#|&)token=([A-Za-z0-9._~-]+)/.exec(location.hash);
  if (m) {
    try { sessionStorage.setItem("ddm-token", m[1]); } catch (e) { /* storage off: keep it in memory */ }
    state.token = m[1];
    history.replaceState(null, "", location.pathname + location.search);
  }
  if (!state.token) {
    try { state.token = sessionStorage.getItem("ddm-token"); } catch (e) { state.token = null; }
  }
  return state.token;
}

function connect() {
  const proto = location.protocol === "https:" ? "wss:" : "ws:";
  const token = viewerToken();
  const protocols = token ? ["ddm.v1", `ddm-token.${token}`] : ["ddm.v1"];
  const ws = new WebSocket(`${proto}//${location.host}/ws`, protocols);
  state.ws = ws;
  setConn("connecting");
  ws.onopen = () => { setConn("open"); state.retryMs = 500; };
  ws.onclose = (ev) => {
    setConn("closed");
    if (ev.code === 1008 && ev.reason) showError(`the server closed the connection: ${ev.reason}`);
    if (ev.code === 1008 && ev.reason.startsWith("token")) state.retryMs = 30000;  // retrying cannot help
    for (const job of state.jobs.values()) {
      if (job.state === "running" || job.state === "submitted") setJobState(job, "failed", "connection lost");
    }
    setTimeout(connect, state.retryMs);
    state.retryMs = Math.min(state.retryMs * 2, 8000);
  };
  ws.onmessage = (ev) => {
    let msg;
    try { msg = JSON.parse(ev.data); } catch (e) { showError(`bad message from server: ${e}`); return; }
    const handler = HANDLERS[msg.type];
    if (handler) handler(msg); else console.warn("unknown message", msg);
  };
}

function setConn(s) {
  const c = $("#conn");
  c.dataset.state = s;
  c.textContent = s === "open" ? "connected" : s === "closed" ? "disconnected – retrying" : "connecting…";
  $("#generate").disabled = s !== "open";
}

function send(obj) {
  if (!state.ws || state.ws.readyState !== WebSocket.OPEN) {
    showError("not connected to the server");
    return false;
  }
  state.ws.send(JSON.stringify(obj));
  return true;
}

// ------------------------------------------------------------------ errors

function showError(text) {
  const list = $("#errors");
  const close = el("button", { type: "button", "aria-label": "dismiss", text: "×" });
  const item = el("li", { class: "error", role: "alert" }, text, close);
  close.onclick = () => item.remove();
  list.prepend(item);
  while (list.children.length > 6) list.lastElementChild.remove();
}

// ------------------------------------------------------------------ kept frames (bounded)

// The page keeps each job's frames so a finished job can be scrubbed, replayed and downloaded.
// Pixels are kept as raw uint8 grey (one byte per pixel, both views), at most KEEP_BYTES in all and for
// at most KEEP_JOBS jobs. Over either bound the oldest finished job loses its kept frames first (its card,
// final images and router timeline stay); if only running jobs are left, the biggest one is thinned
// (every other kept frame dropped; the first and the latest stay). Router weights and experts per step
// (the timeline, a few bytes per image and step) are kept for every job on the page.
const KEEP_BYTES = 64 * 1024 * 1024;
const KEEP_JOBS = 24;
const GIF_MAX_FRAMES = 120;   // a longer trajectory is subsampled for the GIF
const BASE_FPS = 10;          // replay speed 1x = 10 kept frames per second

function b64bytes(b64, out, offset) {
  const bin = atob(b64);
  const n = bin.length;
  for (let i = 0; i < n; i++) out[offset + i] = bin.charCodeAt(i);
  return n;
}

// N base64 tiles of H*W*ch bytes (ch 1: grey, 3: RGB interleaved) -> one Uint8Array [N*H*W*ch]
function decodeTiles(tiles, h, w, ch = 1) {
  const px = h * w * ch;
  const out = new Uint8Array(tiles.length * px);
  tiles.forEach((t, i) => b64bytes(t, out, i * px));
  return out;
}

function frameBytes(f) { return (f.x ? f.x.length : 0) + (f.x1 ? f.x1.length : 0); }

function keptBytes() {
  let total = 0;
  for (const job of state.jobs.values()) total += job.keptBytes;
  return total;
}

function dropTrajectory(job) {
  job.traj = [];
  job.keptBytes = 0;
  job.dropped = true;
  job.cursor = -1;
  job.card.dataset.kept = "0";
  updateScrub(job);
}

function thin(job) {
  const last = job.traj.length - 1;
  job.traj = job.traj.filter((f, i) => i === 0 || i === last || i % 2 === 0);
  job.keptBytes = job.traj.reduce((s, f) => s + frameBytes(f), 0);
  job.thinned = true;
  job.card.dataset.kept = String(job.traj.length);
}

// Enforce KEEP_BYTES / KEEP_JOBS after `job` kept a frame.
function enforceBounds(job) {
  const oldestFinished = () => {
    let pick = null;
    for (const j of state.jobs.values()) {  // insertion order: oldest first
      if (j !== job && j.keptBytes > 0 && j.state !== "running" && j.state !== "submitted") { pick = j; break; }
    }
    return pick;
  };
  let withFrames = [...state.jobs.values()].filter((j) => j.keptBytes > 0).length;
  while (withFrames > KEEP_JOBS) {
    const old = oldestFinished();
    if (!old) break;
    dropTrajectory(old);
    withFrames -= 1;
  }
  let total = keptBytes();
  while (total > KEEP_BYTES) {
    const old = oldestFinished();
    if (old) { total -= old.keptBytes; dropTrajectory(old); continue; }
    let big = job;
    for (const j of state.jobs.values()) if (j.keptBytes > big.keptBytes) big = j;
    if (big.traj.length <= 2) break;
    const before = big.keptBytes;
    thin(big);
    total -= before - big.keptBytes;
  }
  state.stats.keptBytes = total;
}

// ------------------------------------------------------------------ jobs

const PLOT_W = 96, PLOT_H = 28;  // the per-image router timeline (SVG user units = CSS px)
const SVG_NS = "http://www.w3.org/2000/svg";
const svg = (tag, attrs = {}) => {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  return node;
};

function jobCard(jobId, labels) {
  let job = state.jobs.get(jobId);
  if (job) return job;
  const card = $("#job-template").content.firstElementChild.cloneNode(true);
  card.dataset.jobId = jobId;
  card.dataset.frames = "0";
  card.dataset.kept = "0";
  $(".job-title", card).textContent = jobId;
  job = { id: jobId, card, tiles: [], steps: 0, frames: 0, labels: labels || [], state: "submitted",
          traj: [], timeline: [], keptBytes: 0, dropped: false, thinned: false, cursor: -1, view: "x",
          size: [32, 32], ch: 1, final: null, usage: null, seed: null, req: null, K: 0, hasX1: false,
          playTimer: null, compareOf: null, strategy: null };
  $(".cancel", card).onclick = () => send({ type: "cancel", job_id: jobId });
  $(".download-all", card).onclick = () => downloadPNG(job);
  $(".download-gif", card).onclick = () => downloadGIF(job);
  $(".download-npz", card).onclick = () => downloadNPZ(job);
  $(".cmp-run", card).onclick = () => compare(job);
  for (const b of card.querySelectorAll(".view")) b.onclick = () => setView(job, b.dataset.view);
  const range = $(".scrub-range", card);
  range.addEventListener("input", () => { stopPlay(job); showFrame(job, Number(range.value)); });
  $(".play", card).onclick = () => togglePlay(job);
  $(".speed", card).addEventListener("change", () => { if (job.playTimer) { stopPlay(job); startPlay(job); } });
  card.addEventListener("keydown", (ev) => onJobKey(job, ev));
  const served = el("canvas", { class: "served", width: 1, height: 1 });
  $(".served-box", card).append(served);
  served.addEventListener("mousemove", (ev) => hoverServed(job, ev));
  served.addEventListener("mouseleave", hideTip);
  $("#empty-hint").hidden = true;
  $("#jobs").prepend(card);
  state.jobs.set(jobId, job);
  if (job.labels.length) ensureTiles(job, job.labels.length);
  return job;
}

function ensureTiles(job, n) {
  const box = $(".tiles", job.card);
  while (job.tiles.length < n) {
    const i = job.tiles.length;
    const canvas = el("canvas", { width: 32, height: 32, "data-expert": "" });
    const bars = el("div", { class: "bars" });
    const plot = svg("svg", { class: "plot", viewBox: `0 0 ${PLOT_W} ${PLOT_H}`, width: PLOT_W, height: PLOT_H,
                              "aria-label": "router weight per expert over t" });
    plot.style.display = "none";
    const cls = job.labels[i];
    const label = el("div", { class: "label" }, el("span", { text: cls === undefined ? `#${i}` : labelText(cls) }));
    if (cls === NO_DIGIT) label.title = unknownTitle();
    box.append(el("div", { class: "tile" }, canvas, bars, plot, label));
    const tile = { canvas, bars, plot, label, link: null, cursor: null };
    plot.addEventListener("mousemove", (ev) => hoverPlot(job, i, ev));
    plot.addEventListener("mouseleave", hideTip);
    job.tiles.push(tile);
  }
}

function setJobState(job, s, text) {
  job.state = s;
  job.card.dataset.state = s;
  if (text !== undefined) $(".job-status", job.card).textContent = text;
  const finished = s !== "running" && s !== "submitted";
  $(".cancel", job.card).hidden = finished;
  if (finished) stopPlay(job);
}

// uint8 pixels -> canvas: ch 1 grey (H*W bytes), ch 3 RGB interleaved (H*W*3 bytes), from px[offset].
function drawPixels(canvas, px, offset, h, w, ch = 1) {
  if (canvas.width !== w || canvas.height !== h) { canvas.width = w; canvas.height = h; }
  const ctx = canvas.getContext("2d");
  const img = ctx.createImageData(w, h);
  const d = img.data;
  const n = w * h;
  if (ch === 3) {
    for (let i = 0; i < n; i++) {
      const o = offset + 3 * i;
      d[4 * i] = px[o]; d[4 * i + 1] = px[o + 1]; d[4 * i + 2] = px[o + 2]; d[4 * i + 3] = 255;
    }
  } else {
    for (let i = 0; i < n; i++) {
      const v = px[offset + i];
      d[4 * i] = v; d[4 * i + 1] = v; d[4 * i + 2] = v; d[4 * i + 3] = 255;
    }
  }
  ctx.putImageData(img, 0, 0);
}

// Bytes of one tile of a job: H*W*channels.
function tileBytes(job) { return job.size[0] * job.size[1] * job.ch; }

function drawBars(bars, weights) {
  if (!weights) return;
  state.experts = Math.max(state.experts, weights.length);
  while (bars.children.length < weights.length) bars.append(el("span"));
  weights.forEach((w, k) => {
    const s = bars.children[k];
    s.style.height = `${Math.max(1, Math.round(w * 100))}%`;
    s.style.background = expertColor(k);
  });
  bars.title = "router weights: " + weights.map((w, k) => `expert ${k} ${w.toFixed(2)}`).join(", ");
}

// The pixels a frame shows in the job's current view (x1 falls back to x where a frame has none).
function viewPixels(job, f) { return job.view === "x1" && f.x1 ? f.x1 : f.x; }

// Draw kept frame `idx` (or the live frame) into every tile.
function drawFrame(job, f) {
  const [h, w] = job.size;
  const px = viewPixels(job, f);
  const n = Math.min(job.tiles.length, f.experts.length);
  for (let i = 0; i < n; i++) {
    const tile = job.tiles[i];
    if (px) drawPixels(tile.canvas, px, i * h * w * job.ch, h, w, job.ch);
    const e = f.experts[i];
    tile.canvas.dataset.expert = String(e);
    tile.canvas.style.borderColor = expertColor(e);
    tile.canvas.title = e >= 0 ? `step ${f.step}: expert ${e}` : `step ${f.step}: several experts`;
    if (f.weights) drawBars(tile.bars, f.weights[i]);
  }
}

// Live frames are drawn once per animation frame (a burst of frames costs one redraw per job).
function scheduleDraw(job) {
  state.dirty.add(job);
  if (state.drawPending) return;
  state.drawPending = true;
  requestAnimationFrame(() => {
    state.drawPending = false;
    for (const j of state.dirty) if (j.live) drawFrame(j, j.live);
    state.dirty.clear();
  });
}

function onFrame(msg) {
  const t0 = performance.now();
  const job = jobCard(msg.job_id);
  if (job.state !== "running" && job.state !== "submitted") return;
  // a latent fleet's frame without a decoded preview carries no tiles: the tiles keep what they show
  const pixels = msg.tiles.length > 0;
  ensureTiles(job, pixels ? msg.tiles.length : msg.experts.length);
  let f;
  if (pixels) {
    const [h, w] = msg.size;
    const ch = msg.channels || 1;
    job.size = [h, w];
    job.ch = ch;
    f = { step: msg.step, t: msg.t, x: decodeTiles(msg.tiles, h, w, ch),
          x1: msg.x1 ? decodeTiles(msg.x1, h, w, ch) : null, experts: msg.experts, weights: msg.weights };
  } else {
    f = { step: msg.step, t: msg.t, x: null, x1: null, experts: msg.experts, weights: msg.weights };
  }
  if (msg.preview) {
    job.previews = (job.previews || 0) + 1;
    job.card.dataset.previews = String(job.previews);
    job.card.dataset.previewStep = String(msg.step);
  }
  if (f.x1 && !job.hasX1) { job.hasX1 = true; $(".views", job.card).hidden = false; }
  if (msg.weights.length) job.K = Math.max(job.K, msg.weights[0].length);
  job.timeline.push({ step: msg.step, t: msg.t, experts: msg.experts, weights: msg.weights });
  if (!job.dropped && pixels) {
    job.traj.push(f);
    job.keptBytes += frameBytes(f);
    enforceBounds(job);
    job.card.dataset.kept = String(job.traj.length);
  }
  job.live = f;
  scheduleDraw(job);
  job.steps = msg.steps;
  job.frames += 1;
  job.card.dataset.frames = String(job.frames);
  job.card.dataset.step = String(msg.step);
  if (job.frames === 1) job.card.dataset.firstStep = String(msg.step);
  $("progress", job.card).value = msg.steps ? msg.step / msg.steps : 0;
  setJobState(job, "running", `step ${msg.step}/${msg.steps} · t=${msg.t.toFixed(2)}`);
  if (msg.notes && msg.notes.length) $(".job-notes", job.card).textContent = msg.notes.join("; ");
  state.stats.frames += 1;
  state.stats.handleMs += performance.now() - t0;
}

function onDone(msg) {
  const labels = msg.labels || msg.digits;
  const job = jobCard(msg.job_id, labels);
  if (!job.labels.length) job.labels = labels;
  ensureTiles(job, msg.tiles.length);
  const [h, w] = msg.size;
  const ch = msg.channels || 1;
  job.size = [h, w];
  job.ch = ch;
  job.card.dataset.channels = String(ch);
  job.final = decodeTiles(msg.tiles, h, w, ch);
  job.usage = msg.usage;
  job.steps = msg.steps;
  job.strategy = msg.strategy;
  job.live = null;
  state.dirty.delete(job);
  // the final state is the last frame of the trajectory (the frame itself may have been skipped)
  const last = job.traj[job.traj.length - 1];
  const lastT = job.timeline[job.timeline.length - 1];
  if (last && last.step === msg.steps) {  // the exact final images (the frame went through float16)
    const before = frameBytes(last);
    last.x = job.final; last.x1 = job.final;
    job.keptBytes += frameBytes(last) - before;
  } else if (!job.dropped) {
    const experts = lastT ? lastT.experts : msg.tiles.map(() => -1);
    const f = { step: msg.steps, t: 1, x: job.final, x1: job.final, experts, weights: lastT ? lastT.weights : null };
    job.traj.push(f);
    job.keptBytes += frameBytes(f);
  }
  msg.tiles.forEach((_, i) => {
    const tile = job.tiles[i];
    drawPixels(tile.canvas, job.final, i * h * w * ch, h, w, ch);
    tile.canvas.dataset.final = "1";
    if (msg.usage && msg.usage[i]) {
      drawBars(tile.bars, msg.usage[i]);
      tile.bars.title = "share of steps per expert: " + msg.usage[i].map((u, k) => `expert ${k} ${u.toFixed(2)}`).join(", ");
    }
    if (!tile.link) {
      tile.link = el("a", { href: "#", class: "download", text: "PNG", title: "download this image",
                            download: `ddm-${msg.job_id}-${i}-${labelFile(labels[i])}.png` });
      tile.link.onclick = () => { tile.link.href = pngURL([tile.canvas], 4); };
      tile.label.append(tile.link);
    }
  });
  $("progress", job.card).value = 1;
  $(".downloads", job.card).hidden = false;
  $(".compare-form", job.card).hidden = false;
  setJobState(job, "done", `done: ${msg.steps} steps, ${msg.strategy}, ${msg.elapsed_s.toFixed(2)} s`);
  if (msg.notes && msg.notes.length) $(".job-notes", job.card).textContent = msg.notes.join("; ");
  job.cursor = job.traj.length - 1;
  drawTimelines(job);
  updateScrub(job);
  if (job.compareOf) showComparison(job);
  enforceBounds(job);
}

// ------------------------------------------------------------------ scrubbing and replay

function updateScrub(job) {
  const box = $(".scrub", job.card);
  const finished = job.state === "done";
  box.hidden = !finished;
  if (!finished) return;
  const range = $(".scrub-range", job.card);
  const n = job.traj.length;
  job.card.dataset.kept = String(n);
  range.max = String(Math.max(0, n - 1));
  range.disabled = n < 2;
  $(".play", job.card).disabled = n < 2;
  if (n === 0) {
    $(".scrub-label", job.card).textContent = "trajectory dropped (the page keeps a bounded number of frames)";
    return;
  }
  if (job.cursor < 0 || job.cursor >= n) job.cursor = n - 1;
  range.value = String(job.cursor);
  showFrame(job, job.cursor);
}

// Show kept frame `idx` of a finished job: tiles, bars, label, timeline cursors.
function showFrame(job, idx) {
  const f = job.traj[idx];
  if (!f) return;
  job.cursor = idx;
  drawFrame(job, f);
  const range = $(".scrub-range", job.card);
  if (range.value !== String(idx)) range.value = String(idx);
  const thinned = job.thinned ? " · thinned to fit memory" : "";
  $(".scrub-label", job.card).textContent =
    `step ${f.step}/${job.steps} · t=${Number(f.t).toFixed(2)} · frame ${idx + 1}/${job.traj.length}${thinned}`;
  job.card.dataset.cursor = String(f.step);
  drawCursors(job, f.t, f.step);
}

function setView(job, view) {
  job.view = view === "x1" ? "x1" : "x";
  job.card.dataset.view = job.view;
  for (const b of job.card.querySelectorAll(".view")) b.setAttribute("aria-pressed", String(b.dataset.view === job.view));
  if (job.state === "done" && job.traj[job.cursor]) showFrame(job, job.cursor);
  else if (job.live) scheduleDraw(job);
}

function startPlay(job) {
  if (job.traj.length < 2) return;
  if (job.cursor >= job.traj.length - 1) showFrame(job, 0);
  const speed = Number($(".speed", job.card).value) || 1;
  const play = $(".play", job.card);
  play.textContent = "❚❚"; play.setAttribute("aria-label", "pause");
  job.card.dataset.playing = "1";
  job.playTimer = setInterval(() => {
    if (job.cursor >= job.traj.length - 1) { stopPlay(job); return; }
    showFrame(job, job.cursor + 1);
  }, 1000 / (BASE_FPS * speed));
}

function stopPlay(job) {
  if (!job.playTimer) return;
  clearInterval(job.playTimer);
  job.playTimer = null;
  const play = $(".play", job.card);
  play.textContent = "▶"; play.setAttribute("aria-label", "play");
  delete job.card.dataset.playing;
}

function togglePlay(job) { if (job.playTimer) stopPlay(job); else startPlay(job); }

function onJobKey(job, ev) {
  if (job.state !== "done" || !job.traj.length) return;
  const tag = ev.target.tagName;
  if (tag === "SELECT" || (tag === "INPUT" && ev.target.type !== "range")) return;
  const range = ev.target.classList && ev.target.classList.contains("scrub-range");
  let idx = null;
  if (ev.key === "ArrowLeft" && !range) idx = Math.max(0, job.cursor - 1);
  else if (ev.key === "ArrowRight" && !range) idx = Math.min(job.traj.length - 1, job.cursor + 1);
  else if (ev.key === "Home" && !range) idx = 0;
  else if (ev.key === "End" && !range) idx = job.traj.length - 1;
  else if (ev.key === " " && tag !== "BUTTON") { ev.preventDefault(); togglePlay(job); return; }
  if (idx === null) return;
  ev.preventDefault();
  stopPlay(job);
  showFrame(job, idx);
}

// ------------------------------------------------------------------ router timeline

// Per image: each expert's router weight over t (lines in expert colours); for the job: which expert
// served each step of each image (a grid, rows = images, columns = frames). Hover for the numbers.
function drawTimelines(job) {
  const tl = job.timeline;
  if (!tl.length) return;
  const K = job.K || state.experts || 1;
  job.tiles.forEach((tile, i) => {
    const lines = [];
    for (let k = 0; k < K; k++) {
      const pts = tl.map((f) => {
        const w = f.weights[i] ? f.weights[i][k] || 0 : 0;
        return `${(f.t * (PLOT_W - 2) + 1).toFixed(1)},${((1 - w) * (PLOT_H - 4) + 2).toFixed(1)}`;
      });
      const line = svg("polyline", { points: pts.join(" "), class: "weight", "data-expert": String(k) });
      line.style.stroke = expertColor(k);
      lines.push(line);
    }
    tile.cursor = svg("line", { class: "cursor", x1: 0, x2: 0, y1: 0, y2: PLOT_H });
    tile.plot.replaceChildren(...lines, tile.cursor);
    tile.plot.style.display = "";
  });
  const n = Math.min(job.tiles.length, 64);
  const served = $(".served", job.card);
  const cols = tl.length;
  served.width = cols; served.height = n;
  const ctx = served.getContext("2d");
  const img = ctx.createImageData(cols, n);
  const rgb = (hex) => [1, 3, 5].map((o) => parseInt(hex.slice(o, o + 2), 16));
  tl.forEach((f, j) => {
    for (let i = 0; i < n; i++) {
      const [r, g, b] = rgb(expertColor(f.experts[i]));
      const o = 4 * (i * cols + j);
      img.data[o] = r; img.data[o + 1] = g; img.data[o + 2] = b; img.data[o + 3] = 255;
    }
  });
  ctx.putImageData(img, 0, 0);
  job.servedBase = img;
  served.style.height = `${Math.min(96, Math.max(8, n * 6))}px`;
  $(".served-box", job.card).hidden = false;
}

function drawCursors(job, t, step) {
  const x = (t * (PLOT_W - 2) + 1).toFixed(1);
  job.tiles.forEach((tile) => {
    if (!tile.cursor) return;
    tile.cursor.setAttribute("x1", x); tile.cursor.setAttribute("x2", x);
  });
  const served = $(".served", job.card);
  if (job.servedBase) {
    const ctx = served.getContext("2d");
    ctx.putImageData(job.servedBase, 0, 0);
    const col = job.timeline.findIndex((f) => f.step >= step);
    if (col >= 0) { ctx.fillStyle = "rgba(255,255,255,0.6)"; ctx.fillRect(col, 0, 1, served.height); }
  }
}

function nearestEntry(tl, t) {
  let best = 0;
  for (let j = 1; j < tl.length; j++) if (Math.abs(tl[j].t - t) < Math.abs(tl[best].t - t)) best = j;
  return tl[best];
}

function weightsText(w) { return w ? w.map((v, k) => `expert ${k} ${Number(v).toFixed(3)}`).join(" · ") : "no weights"; }

function servedText(e) { return e >= 0 ? `served by expert ${e}` : "served by several experts"; }

function hoverPlot(job, i, ev) {
  const tl = job.timeline;
  if (!tl.length) return;
  const c = job.tiles[i].plot;
  const r = c.getBoundingClientRect();
  const t = Math.min(1, Math.max(0, (ev.clientX - r.left) / r.width));
  const f = nearestEntry(tl, t);
  showTip(ev, `image ${i} (${labelText(job.labels[i])}) · step ${f.step} · t=${Number(f.t).toFixed(2)}\n` +
              `${weightsText(f.weights[i])}\n${servedText(f.experts[i])}`);
}

function hoverServed(job, ev) {
  const tl = job.timeline;
  if (!tl.length) return;
  const c = $(".served", job.card);
  const r = c.getBoundingClientRect();
  const j = Math.min(tl.length - 1, Math.max(0, Math.floor((ev.clientX - r.left) / r.width * tl.length)));
  const i = Math.min(c.height - 1, Math.max(0, Math.floor((ev.clientY - r.top) / r.height * c.height)));
  const f = tl[j];
  showTip(ev, `image ${i} (${labelText(job.labels[i])}) · step ${f.step} · t=${Number(f.t).toFixed(2)}\n` +
              `${servedText(f.experts[i])}\n${weightsText(f.weights[i])}`);
}

function showTip(ev, text) {
  const tip = $("#tip");
  tip.textContent = text;
  tip.hidden = false;
  tip.style.left = `${Math.min(ev.clientX + 14, window.innerWidth - 280)}px`;
  tip.style.top = `${ev.clientY + 14}px`;
}

function hideTip() { $("#tip").hidden = true; }

// ------------------------------------------------------------------ compare (same seed, other routing)

function compare(job) {
  if (job.seed === null || !job.labels.length) { showError("this job has no seed or labels to rerun"); return; }
  const strategy = $(".cmp-strategy", job.card).value;
  const solver = $(".cmp-solver", job.card).value;
  const req = { type: "generate", ref: state.nextRef++, labels: job.labels.slice(), seed: job.seed,
                steps: job.steps, strategy, solver };
  if (strategy === "topk") req.top_k = (job.req && job.req.top_k) || 2;
  if ($("#frame_x1").checked) req.frame_x1 = true;
  // the same scale: the one the original asked for, or (none asked) the fleet's default again
  if (job.req && typeof job.req.guidance_scale === "number") req.guidance_scale = job.req.guidance_scale;
  if (send(req)) state.pending.set(req.ref, { ...req, compareOf: job.id });
}

function describe(job) {
  const r = job.req;
  if (!r) return job.strategy || "?";
  let guidance = guided(r.guidance_scale) ? ` · guidance ${r.guidance_scale}` : "";
  if (r.guidance_scale === undefined && guided(r.fleet_guidance)) guidance = ` · guidance ${r.fleet_guidance} (fleet default)`;
  return `${r.strategy === "topk" ? `top-${r.top_k}` : r.strategy} · ${r.solver}${guidance}`;
}

// A classifier-free guidance scale that guides: a number other than 1 (1 is off; none asked: the fleet's default).
const guided = (scale) => typeof scale === "number" && scale !== 1;

// Place a comparison under its original: A (the original's final images), B (this job), |A − B|.
function linkComparison(job, orig) {
  job.compareOf = orig;
  orig.card.after(job.card);
  job.card.classList.add("comparison");
  job.card.dataset.compareOf = orig.id;
  const a = $(".cmp-a", job.card);
  a.hidden = false;
  a.replaceChildren(el("div", { class: "row-label", text: `A · ${describe(orig)}` }));
  const [h, w] = orig.size;
  orig.tiles.forEach((t, i) => {
    const c = el("canvas", { width: w, height: h });
    if (orig.final) drawPixels(c, orig.final, i * h * w * orig.ch, h, w, orig.ch);
    c.style.borderColor = t.canvas.style.borderColor;
    a.append(el("div", { class: "ctile" }, c, el("div", { class: "label", text: labelText(orig.labels[i]) })));
  });
  $(".tiles", job.card).dataset.label = `B · ${describe(job)}`;
}

function showComparison(job) {
  const orig = job.compareOf;
  if (!orig.final || !job.final || orig.final.length !== job.final.length) return;
  const [h, w] = job.size;
  const ch = job.ch;
  const px = h * w * ch;  // bytes per tile: the mean |A - B| is over every channel
  const box = $(".cmp-diff", job.card);
  box.hidden = false;
  box.replaceChildren(el("div", { class: "row-label", text: "|A − B|" }));
  const diffs = [];
  job.tiles.forEach((_, i) => {
    const d = new Uint8Array(px);
    let sum = 0;
    for (let p = 0; p < px; p++) {
      const v = Math.abs(orig.final[i * px + p] - job.final[i * px + p]);
      d[p] = v; sum += v;
    }
    const mean = sum / px;
    diffs.push(mean);
    const c = el("canvas", { width: w, height: h, class: "diff" });
    drawPixels(c, d, 0, h, w, ch);
    box.append(el("div", { class: "ctile", "data-mad": mean.toFixed(2) }, c,
      el("div", { class: "label", text: `mean |Δ| ${mean.toFixed(1)}` })));
  });
  const overall = diffs.reduce((s, v) => s + v, 0) / Math.max(1, diffs.length);
  job.card.dataset.meanAbsDiff = overall.toFixed(3);
  $(".job-notes", job.card).textContent =
    `same seed ${job.seed}: ${describe(orig)} (A) vs ${describe(job)} (B); mean |A − B| = ${overall.toFixed(2)} grey levels of 255`;
}

// ------------------------------------------------------------------ downloads (made in the page)

function gridCanvas(job, px, scale) {
  const [h, w] = job.size;
  const n = job.tiles.length;
  const cols = Math.min(n, 10), rows = Math.ceil(n / cols), gap = 2;
  const out = document.createElement("canvas");
  out.width = cols * (w * scale + gap) + gap; out.height = rows * (h * scale + gap) + gap;
  const ctx = out.getContext("2d");
  ctx.fillStyle = "#000"; ctx.fillRect(0, 0, out.width, out.height);
  ctx.imageSmoothingEnabled = false;
  const one = document.createElement("canvas");
  for (let i = 0; i < n; i++) {
    drawPixels(one, px, i * h * w * job.ch, h, w, job.ch);
    ctx.drawImage(one, gap + (i % cols) * (w * scale + gap), gap + Math.floor(i / cols) * (h * scale + gap), w * scale, h * scale);
  }
  return out;
}

function saveBlob(blob, name) {
  const url = URL.createObjectURL(blob);
  const a = el("a", { href: url, download: name });
  document.body.append(a); a.click(); a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 60_000);
}

function downloadPNG(job) {
  if (!job.final) return;
  gridCanvas(job, job.final, 2).toBlob((b) => saveBlob(b, `ddm-${job.id}.png`), "image/png");
}

// Same grid layout as GIF frames (the current view: x_t or predicted x1): 256 grey levels, or for RGB
// fleets 256 colours (3 bits red, 3 green, 2 blue: a GIF frame has at most 256 colours).
function downloadGIF(job) {
  let frames = job.traj.length ? job.traj : (job.final ? [{ x: job.final, x1: job.final }] : []);
  if (!frames.length) return;
  if (frames.length > GIF_MAX_FRAMES) {
    const stride = frames.length / GIF_MAX_FRAMES;
    frames = Array.from({ length: GIF_MAX_FRAMES }, (_, i) => frames[Math.floor(i * stride)]).concat([frames[frames.length - 1]]);
  }
  const scale = 2;
  const first = gridCanvas(job, viewPixels(job, frames[0]), scale);
  const W = first.width, H = first.height;
  const rgb = job.ch === 3;
  const greys = frames.map((f) => {
    const c = f === frames[0] ? first : gridCanvas(job, viewPixels(job, f), scale);
    const rgba = c.getContext("2d").getImageData(0, 0, W, H).data;
    const g = new Uint8Array(W * H);
    if (rgb) for (let i = 0; i < g.length; i++) g[i] = (rgba[4 * i] & 0xe0) | ((rgba[4 * i + 1] >> 3) & 0x1c) | (rgba[4 * i + 2] >> 6);
    else for (let i = 0; i < g.length; i++) g[i] = rgba[4 * i];
    return g;
  });
  const speed = Number($(".speed", job.card).value) || 1;
  const delayCs = Math.max(2, Math.round(100 / (BASE_FPS * speed)));
  saveBlob(new Blob([encodeGIF(W, H, greys, delayCs, rgb)], { type: "image/gif" }), `ddm-${job.id}-${job.view}.gif`);
}

function downloadNPZ(job) {
  if (!job.final) return;
  const [h, w] = job.size;
  const n = job.tiles.length, K = job.K || (job.usage && job.usage[0] ? job.usage[0].length : 0);
  const F = job.traj.length;
  const tile = job.ch === 3 ? [h, w, 3] : [h, w];  // RGB images as [.., H, W, 3]
  const per = n * h * w * job.ch;
  const files = [
    ["images.npy", npy("|u1", [n, ...tile], job.final)],
    ["labels.npy", npy("<i4", [n], Int32Array.from(job.labels))],
    ["usage.npy", npy("<f4", [n, K], Float32Array.from((job.usage || []).flat()))],
  ];
  const frames = new Uint8Array(F * per), frames1 = new Uint8Array(F * per);
  const weights = new Float32Array(F * n * K), experts = new Int32Array(F * n);
  job.traj.forEach((f, j) => {
    frames.set(f.x, j * per);
    frames1.set(f.x1 || f.x, j * per);
    for (let i = 0; i < n; i++) {
      experts[j * n + i] = f.experts[i];
      for (let k = 0; k < K; k++) weights[(j * n + i) * K + k] = f.weights && f.weights[i] ? f.weights[i][k] : NaN;
    }
  });
  files.push(["frame_steps.npy", npy("<i4", [F], Int32Array.from(job.traj.map((f) => f.step)))]);
  files.push(["frame_t.npy", npy("<f4", [F], Float32Array.from(job.traj.map((f) => f.t)))]);
  files.push(["frames.npy", npy("|u1", [F, n, ...tile], frames)]);
  if (job.hasX1) files.push(["frames_x1.npy", npy("|u1", [F, n, ...tile], frames1)]);
  files.push(["frame_experts.npy", npy("<i4", [F, n], experts)]);
  files.push(["frame_weights.npy", npy("<f4", [F, n, K], weights)]);
  saveBlob(new Blob([zipStored(files)], { type: "application/zip" }), `ddm-${job.id}.npz`);
}

// .npy v1.0: magic, header dict padded so the data starts on a 64-byte boundary, raw little-endian data.
function npy(descr, shape, typed) {
  const shapeText = shape.length === 1 ? `(${shape[0]},)` : `(${shape.join(", ")})`;
  let header = `{'descr': '${descr}', 'fortran_order': False, 'shape': ${shapeText}, }`;
  const total = 10 + header.length + 1;
  header += " ".repeat((64 - (total % 64)) % 64) + "\n";
  const bytes = new Uint8Array(typed.buffer, typed.byteOffset, typed.byteLength);
  const out = new Uint8Array(10 + header.length + bytes.length);
  out.set([0x93, 0x4e, 0x55, 0x4d, 0x50, 0x59, 1, 0], 0);
  out[8] = header.length & 255; out[9] = header.length >> 8;
  for (let i = 0; i < header.length; i++) out[10 + i] = header.charCodeAt(i);
  out.set(bytes, 10 + header.length);
  return out;
}

let CRC_TABLE = null;
function crc32(bytes) {
  if (!CRC_TABLE) {
    CRC_TABLE = new Uint32Array(256);
    for (let n = 0; n < 256; n++) {
      let c = n;
      for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
      CRC_TABLE[n] = c >>> 0;
    }
  }
  let crc = 0xffffffff;
  for (let i = 0; i < bytes.length; i++) crc = CRC_TABLE[(crc ^ bytes[i]) & 255] ^ (crc >>> 8);
  return (crc ^ 0xffffffff) >>> 0;
}

// A zip archive of uncompressed ("stored") entries: [[name, Uint8Array], ...] -> Uint8Array.
function zipStored(files) {
  const enc = new TextEncoder();
  const parts = [], central = [];
  let offset = 0;
  for (const [name, data] of files) {
    const nm = enc.encode(name), crc = crc32(data);
    const local = new DataView(new ArrayBuffer(30));
    local.setUint32(0, 0x04034b50, true); local.setUint16(4, 20, true); local.setUint16(6, 0, true);
    local.setUint16(8, 0, true); local.setUint16(10, 0, true); local.setUint16(12, 0x21, true);
    local.setUint32(14, crc, true); local.setUint32(18, data.length, true); local.setUint32(22, data.length, true);
    local.setUint16(26, nm.length, true); local.setUint16(28, 0, true);
    const cd = new DataView(new ArrayBuffer(46));
    cd.setUint32(0, 0x02014b50, true); cd.setUint16(4, 20, true); cd.setUint16(6, 20, true);
    cd.setUint16(8, 0, true); cd.setUint16(10, 0, true); cd.setUint16(12, 0, true); cd.setUint16(14, 0x21, true);
    cd.setUint32(16, crc, true); cd.setUint32(20, data.length, true); cd.setUint32(24, data.length, true);
    cd.setUint16(28, nm.length, true); cd.setUint32(42, offset, true);
    parts.push(new Uint8Array(local.buffer), nm, data);
    central.push(new Uint8Array(cd.buffer), nm);
    offset += 30 + nm.length + data.length;
  }
  const cdSize = central.reduce((s, p) => s + p.length, 0);
  const end = new DataView(new ArrayBuffer(22));
  end.setUint32(0, 0x06054b50, true); end.setUint16(8, files.length, true); end.setUint16(10, files.length, true);
  end.setUint32(12, cdSize, true); end.setUint32(16, offset, true);
  const all = [...parts, ...central, new Uint8Array(end.buffer)];
  const out = new Uint8Array(all.reduce((s, p) => s + p.length, 0));
  let at = 0;
  for (const p of all) { out.set(p, at); at += p.length; }
  return out;
}

// Animated GIF89a, looping; frames: Uint8Array [H*W] of palette indices. The global colour table is 256 grey
// levels, or with `rgb332` 256 colours: index bits rrrgggbb.
function encodeGIF(W, H, frames, delayCs, rgb332 = false) {
  const out = [];
  const u8 = (v) => out.push(v & 255);
  const u16 = (v) => { out.push(v & 255, (v >> 8) & 255); };
  const text = (s) => { for (const ch of s) out.push(ch.charCodeAt(0)); };
  text("GIF89a"); u16(W); u16(H); u8(0xf7); u8(0); u8(0);
  for (let i = 0; i < 256; i++) {
    if (rgb332) out.push(Math.round((i >> 5) * 255 / 7), Math.round(((i >> 2) & 7) * 255 / 7), Math.round((i & 3) * 255 / 3));
    else out.push(i, i, i);
  }
  u8(0x21); u8(0xff); u8(11); text("NETSCAPE2.0"); u8(3); u8(1); u16(0); u8(0);
  frames.forEach((px, j) => {
    u8(0x21); u8(0xf9); u8(4); u8(0x04); u16(j === frames.length - 1 ? 150 : delayCs); u8(0); u8(0);
    u8(0x2c); u16(0); u16(0); u16(W); u16(H); u8(0);
    u8(8);
    const data = lzw(px);
    for (let i = 0; i < data.length; i += 255) {
      const n = Math.min(255, data.length - i);
      u8(n);
      for (let k = 0; k < n; k++) out.push(data[i + k]);
    }
    u8(0);
  });
  u8(0x3b);
  return Uint8Array.from(out);
}

// GIF LZW with 8-bit pixels: variable code width 9..12 bits, a clear code when the table is full.
function lzw(px) {
  const CLEAR = 256, EOI = 257;
  const out = [];
  let cur = 0, bits = 0, size = 9, next = 258;
  let dict = new Map();
  const emit = (code) => {
    cur |= code << bits; bits += size;
    while (bits >= 8) { out.push(cur & 255); cur >>>= 8; bits -= 8; }
  };
  emit(CLEAR);
  let prefix = px[0];
  for (let i = 1; i < px.length; i++) {
    const k = px[i];
    const key = prefix * 256 + k;
    const hit = dict.get(key);
    if (hit !== undefined) { prefix = hit; continue; }
    emit(prefix);
    if (next < 4096) {
      dict.set(key, next++);
      if (next > (1 << size) && size < 12) size++;
    } else {
      emit(CLEAR);
      dict = new Map(); next = 258; size = 9;
    }
    prefix = k;
  }
  emit(prefix);
  emit(EOI);
  if (bits > 0) out.push(cur & 255);
  return out;
}

// PNG of canvases side by side, each scaled up `scale` times without smoothing.
function pngURL(canvases, scale) {
  const w = canvases[0].width * scale, h = canvases[0].height * scale;
  const out = document.createElement("canvas");
  out.width = w * canvases.length; out.height = h;
  const ctx = out.getContext("2d");
  ctx.imageSmoothingEnabled = false;
  canvases.forEach((c, i) => ctx.drawImage(c, i * w, 0, w, h));
  return out.toDataURL("image/png");
}

// The fleet's spec: what the form asks for (class names or digits) and how tiles are captioned.
function onSpec(msg) {
  state.spec = msg;
  document.body.dataset.channels = String(msg.tile_channels || 1);
  document.body.dataset.space = msg.space || "pixels";
  const latent = msg.space === "latent";
  const x1 = $("#frame_x1");
  x1.disabled = latent;  // a latent fleet's x̂1 is latents: the page draws decoded previews instead
  x1.parentElement.title = latent ? "not on a latent fleet: its frames show the decoder's previews" : "";
  renderSpace();
  guidanceFor(msg);
  document.body.dataset.classes = String(msg.num_classes);
  const input = $("#digits");
  const names = msg.class_names || [];
  const digits = !!msg.digits;
  $("#labels-word").textContent = digits ? "digits" : "classes";
  $("#uncond-word").textContent = digits ? "unconditional (no digit)" : "unconditional (label unknown)";
  const shown = names.length > 12 ? `${names.slice(0, 12).join(", ")}, … (${names.length})` : names.join(", ");
  input.title = digits
    ? "digits 0-9, comma separated; ? = no digit (label unknown: the router alone picks the experts)"
    : `class names or numbers 0-${names.length - 1}, comma separated; ? = label unknown. Classes: ${shown}`;
  input.setAttribute("aria-label", digits ? "digits, comma separated (? = no digit)" : "classes, comma separated (? = unknown)");
  input.placeholder = digits ? "e.g. 3,7,7 or ?,?,4" : `e.g. ${names.slice(0, 3).join(", ")}`;
  // the untouched default input follows the fleet: its first ten classes (back to 0-9 on an MNIST fleet)
  if (!digits && input.value === DEFAULT_DIGITS && names.length) {
    input.value = names.slice(0, 10).join(", ");
    input.dataset.fromSpec = "1";
  } else if (digits && input.dataset.fromSpec === "1") {
    input.value = DEFAULT_DIGITS;
    delete input.dataset.fromSpec;
  }
  $("#count").setAttribute("aria-label", digits ? "number of random digits" : "number of random classes");
}

// Classifier-free guidance needs the null label (v(x, null) is half of each guided velocity): on a fleet
// known to lack one the input is disabled and says why; until a coordinator has answered it stays usable.
const GUIDANCE_TITLE = "classifier-free guidance scale, 0-20: 1 = off, typically 1.5-7 (sharper, more typical "
  + "images of each label; one more expert evaluation per labelled image); empty: the fleet's default; the "
  + "experts need a null label";
function guidanceFor(spec) {
  const input = $("#guidance");
  let why = "";
  if (spec.known && spec.conditioning === "none") why = "this fleet is unconditional: there are no labels to guide";
  else if (spec.known && !spec.null_label) {
    why = "this fleet's experts have no null label (train-expert --label-dropout > 0): it cannot guide";
  }
  input.disabled = why !== "";
  input.title = why;
  // what an empty box gives: the fleet's default scale, once the coordinator has said it
  const d = spec.default_guidance_scale;
  input.placeholder = typeof d === "number" && !why ? `fleet ${d}` : "fleet";
  $("#guidance-label").title = why ? `guidance off: ${why}` : GUIDANCE_TITLE;
}

const HANDLERS = {
  hello: (msg) => { state.limits = msg; },
  spec: onSpec,
  pong: () => {},
  accepted: (msg) => {
    const req = state.pending.get(msg.ref);
    state.pending.delete(msg.ref);
    const labels = msg.labels || msg.digits;
    const job = jobCard(msg.job_id, labels);
    job.seed = msg.seed;
    if (req) {
      job.req = { steps: req.steps, strategy: req.strategy, solver: req.solver, top_k: req.top_k || 2,
                  guidance_scale: req.guidance_scale,  // undefined: the fleet's default, this one (if said)
                  fleet_guidance: fleetSpec().default_guidance_scale };
      $(".job-notes", job.card).textContent = `${req.steps} steps · ${describe(job)}`;
    }
    if (!job.labels.length) { job.labels = labels; }
    ensureTiles(job, labels.length);
    job.tiles.forEach((t, i) => {
      $("span", t.label).textContent = labelText(labels[i]);
      if (labels[i] === NO_DIGIT) t.label.title = unknownTitle(); else t.label.removeAttribute("title");
    });
    const unknown = labels.filter((d) => d === NO_DIGIT).length;
    const n = labels.length;
    const uncond = !unknown ? "" : unknown === n ? " · unconditional" : ` · ${unknown} unconditional`;
    $(".job-title", job.card).textContent = `${n} image${n === 1 ? "" : "s"}${uncond} · seed ${msg.seed}`;
    $(".job-title", job.card).title = msg.job_id;
    const orig = req && req.compareOf && state.jobs.get(req.compareOf);
    if (orig) linkComparison(job, orig);
    if (job.state === "submitted") {
      setJobState(job, "submitted", msg.queue_position ? `queued (position ${msg.queue_position})` : "accepted");
    }
  },
  frame: onFrame,
  done: onDone,
  failed: (msg) => {
    const job = jobCard(msg.job_id);
    setJobState(job, "failed", `failed (${msg.code}): ${msg.reason}`);
    showError(`job failed (${msg.code}): ${msg.reason}`);
  },
  rejected: (msg) => {
    state.pending.delete(msg.ref);
    showError(`job rejected (${msg.code}): ${msg.message}`);
    const job = state.jobs.get(msg.job_id);
    if (job) setJobState(job, "rejected", `rejected: ${msg.message}`);
  },
  cancelled: (msg) => {
    const job = state.jobs.get(msg.job_id);
    if (job) setJobState(job, "cancelled", "cancelled");
  },
  error: (msg) => {
    state.pending.delete(msg.ref);
    showError(msg.message);
    const job = msg.job_id && state.jobs.get(msg.job_id);
    if (job && (job.state === "submitted" || job.state === "running")) setJobState(job, "failed", msg.message);
  },
  fleet: renderFleet,
};

// ------------------------------------------------------------------ form

function readForm() {
  const mode = $("input[name=mode]:checked").value;
  const req = { type: "generate", ref: state.nextRef++ };
  if (mode === "digits") req.labels = $("#digits").value;  // class names or indices, read by the server
  else req.count = numberOrText($("#count"));
  if ($("#unconditional").checked) unconditional(req);
  req.steps = numberOrText($("#steps"));
  req.solver = $("#solver").value;
  req.strategy = $("#strategy").value;
  if (req.strategy === "topk") req.top_k = numberOrText($("#top_k"));
  const seed = $("#seed").value.trim();
  if (seed !== "") req.seed = seed;  // as text: seeds reach 2**63, JS numbers are exact to 2**53
  if ($("#frame_x1").checked) req.frame_x1 = true;
  const guidance = $("#guidance");  // disabled on a fleet without a null label (onSpec)
  if (!guidance.disabled) {
    const scale = numberOrText(guidance);
    if (scale !== "") req.guidance_scale = scale;  // empty: the fleet's default; 1 turns guidance off
  }
  return req;
}

// "unconditional (no digit)": the same number of images, every one with label -1 (unknown). A count
// the server would refuse anyway (not a whole number, over the per-job limit) goes as typed, so it says why.
function unconditional(req) {
  if (req.labels !== undefined) {
    const text = req.labels.trim();  // split as the server does: by commas / semicolons, else by spaces
    const tokens = (/[,;]/.test(text) ? text.split(/\s*[,;]\s*/) : text.split(/\s+/)).filter((tok) => tok !== "");
    if (tokens.length) req.labels = tokens.map(() => "?").join(",");
    return;
  }
  const max = (state.limits && state.limits.max_images) || 256;
  if (Number.isInteger(req.count) && req.count >= 1 && req.count <= max) {
    req.labels = new Array(req.count).fill(NO_DIGIT);
    delete req.count;
  }
}

// Numbers go as numbers; anything else goes as typed so the server can say what is wrong with it.
function numberOrText(input) {
  const raw = input.value.trim();
  if (raw === "" && input.validity && input.validity.badInput) return "(not a number)";
  const n = Number(raw);
  return raw !== "" && Number.isFinite(n) ? n : raw;
}

// ------------------------------------------------------------------ fleet panel

const HISTORY_S = 300;  // sparklines cover the last 5 minutes of fleet snapshots

// What the fleet works on: pixels, or latents decoded by a named decoder (and how many decoder processes run).
function renderSpace() {
  const box = $("#fleet-space");
  const spec = fleetSpec();
  if (spec.space !== "latent") { box.hidden = true; box.replaceChildren(); return; }
  const decoders = state.decoders || [];
  const mine = decoders.filter((d) => spec.decoder && spec.decoder.endsWith(d.decoder));
  const shape = (spec.sample_shape || []).join("×");
  const image = mine.length && mine[0].image_shape ? ` → ${mine[0].image_shape.split(",").join("×")} images` : "";
  const procs = mine.length ? `${mine.length} decoder process${mine.length === 1 ? "" : "es"}${image}` : "no decoder running";
  box.replaceChildren(
    el("b", { text: "latent fleet" }), ` · ${shape} latents · decoder `,
    el("code", { class: "decoder-name", text: spec.decoder || "?", title: spec.decoder || "" }),
    el("span", { class: "decoders", text: ` · ${procs}` }));
  box.dataset.decoders = String(mine.length);
  box.hidden = false;
}

function renderFleet(msg) {
  state.decoders = (msg.services || []).filter((s) => s.decoder);
  renderSpace();
  const box = $("#fleet-experts");
  box.replaceChildren();
  if (!msg.experts.length) box.append(el("p", { class: "hint", text: "no expert workers discovered" }));
  for (const ex of msg.experts) {
    state.experts = Math.max(state.experts, ex.expert + 1);
    // five narrow columns: the panel is 320 px wide (backend, device and dtype share one cell, two lines)
    const table = el("table", {}, el("tr", {}, ...["worker @ host", "runs on", "rows/s", "ms", "reqs"].map((h) => el("th", { text: h }))));
    for (const w of ex.workers) {
      const rate = w.rows_per_s === null || w.rows_per_s === undefined ? "…" : `${w.rows_per_s}${w.rate_unit === "req/s" ? " req" : ""}`;
      const lat = w.latency_ms === null || w.latency_ms === undefined ? "…" : Number(w.latency_ms).toFixed(1);
      const who = el("td", { class: "who", title: `${w.name} ${w.version} · id ${w.id} · host ${w.host || "?"}`.trim() },
        el("span", { text: w.id.slice(-8) }), el("span", { class: "host", text: w.host ? `@ ${w.host}` : "" }));
      // a worker that missed the last discovery round (late reply on a busy host) is kept one round, greyed
      table.append(el("tr", { class: w.stale ? "worker stale" : "worker", "data-worker-id": w.id, "data-host": w.host || "",
        title: w.stale ? "missed the last discovery round: last seen one snapshot ago" : "" },
        who,
        el("td", { class: "runs", title: `backend ${w.backend || "?"} · device ${w.device || "?"} · ${w.dtype || "?"}${w.compiled ? " · compiled forward (torch.compile)" : ""}` },
          el("span", { class: "where", text: `${w.backend || "?"} · ${w.device || "?"}` }),
          el("span", { class: "dtype", text: `${w.dtype || "?"}${w.compiled ? ", compiled" : ""}` })),
        el("td", { class: "n", text: rate }), el("td", { class: "n", text: lat }),
        el("td", { class: "n", text: w.requests ?? "" })));
    }
    const title = el("h4", {}, el("span", { class: "swatch" }), `expert ${ex.expert} · ${ex.workers.length} worker${ex.workers.length === 1 ? "" : "s"}`);
    title.firstChild.style.background = expertColor(ex.expert);
    box.append(el("div", { class: "expert", "data-expert": String(ex.expert) }, title, table));
  }
  const coord = $("#fleet-coordinator");
  coord.replaceChildren();
  coord.classList.toggle("stale", !!msg.coordinator_stale);
  if (!msg.coordinator) coord.append(el("p", { class: "hint", text: "not answering" }));
  else {
    // one late answer on a busy host: the last one, greyed, rather than "not answering"
    if (msg.coordinator_stale) coord.append(el("p", { class: "hint stale-note", text: "no answer this time: its last status" }));
    const main = {}, more = {};
    for (const [k, v] of Object.entries(msg.coordinator)) (COORD_MAIN.includes(k) ? main : more)[k] = v;
    coord.append(kvTable(main));
    if (Object.keys(more).length) {
      const details = el("details", {}, el("summary", { text: "more" }), kvTable(more));
      details.open = state.coordMoreOpen || false;
      details.addEventListener("toggle", () => { state.coordMoreOpen = details.open; });
      coord.append(details);
    }
  }
  const svc = $("#fleet-services");
  svc.replaceChildren();
  if (msg.services && msg.services.length) {
    svc.append(el("h3", { text: "Other services" }));
    const t = el("table");
    for (const s of msg.services) t.append(el("tr", {}, el("td", { text: s.name }), el("td", { text: s.id.slice(-8) })));
    svc.append(t);
  }
  recordFleet(msg);
  renderSparks();
  renderLegend();
  state.fleetTime = msg.time;
  updateFleetAge();
}

// One history point per snapshot: rows/s (the coordinator's, else the workers' sum), queue depth, and
// each expert's mean request latency (ms, over its workers that served requests since the last snapshot).
function recordFleet(msg) {
  const c = (!msg.coordinator_stale && msg.coordinator) || {}; // a repeated status is no new point
  let rows = typeof c.rows_per_s === "number" ? c.rows_per_s : null;
  if (rows === null) {
    const rates = msg.experts.flatMap((e) => e.workers.map((w) => w.rows_per_s)).filter((v) => typeof v === "number");
    rows = rates.length ? rates.reduce((s, v) => s + v, 0) : null;
  }
  const queue = typeof c.queued_jobs === "number" ? c.queued_jobs : typeof c.queue_depth === "number" ? c.queue_depth : null;
  const latency = {};
  for (const e of msg.experts) {
    const ls = e.workers.map((w) => w.latency_ms).filter((v) => typeof v === "number");
    latency[e.expert] = ls.length ? ls.reduce((s, v) => s + v, 0) / ls.length : null;
  }
  state.history.push({ time: msg.time, rows, queue, latency });
  while (state.history.length && state.history[0].time < msg.time - HISTORY_S) state.history.shift();
  if (state.history.length > 1000) state.history.shift();
}

function renderSparks() {
  const box = $("#sparks");
  const h = state.history;
  if (!box.childElementCount) {
    for (const [key, label] of [["rows", "rows/s"], ["queue", "queued jobs"], ["latency", "latency ms"]]) {
      const c = el("canvas", { class: "spark", width: 180, height: 28, "data-key": key });
      c.addEventListener("mousemove", (ev) => hoverSpark(key, c, ev));
      c.addEventListener("mouseleave", hideTip);
      box.append(el("div", { class: "spark-row", "data-key": key }, el("span", { class: "spark-label", text: label }), c,
                    el("span", { class: "spark-value n" })));
    }
  }
  const experts = [...new Set(h.flatMap((p) => Object.keys(p.latency).map(Number)))].sort((a, b) => a - b);
  const series = {
    rows: [{ color: "#4f8cff", values: h.map((p) => p.rows) }],
    queue: [{ color: "#e6e8ec", values: h.map((p) => p.queue) }],
    latency: experts.map((k) => ({ color: expertColor(k), values: h.map((p) => p.latency[k] ?? null) })),
  };
  for (const [key, lines] of Object.entries(series)) {
    const row = $(`.spark-row[data-key=${key}]`, box);
    drawSpark($("canvas", row), h.map((p) => p.time), lines);
    const last = h.length ? h[h.length - 1] : null;
    let text = "…";
    if (last && key === "latency") {
      text = experts.map((k) => (last.latency[k] === null || last.latency[k] === undefined ? "…" : last.latency[k].toFixed(1))).join(" / ") || "…";
    } else if (last && last[key] !== null) text = String(Math.round(last[key] * 10) / 10);
    $(".spark-value", row).textContent = text;
  }
  box.dataset.points = String(h.length);
  if (h.length) box.title = `the last ${Math.round(sparkSpan(h.map((p) => p.time))[1])} s (at most ${HISTORY_S / 60} min)`;
}

// The time axis: from the oldest kept snapshot (at most HISTORY_S ago) to the newest.
function sparkSpan(times) {
  const t1 = times[times.length - 1];
  const t0 = Math.max(times[0], t1 - HISTORY_S);
  return [t0, Math.max(t1 - t0, 1)];
}

function drawSpark(c, times, lines) {
  const ctx = c.getContext("2d");
  const W = c.width, H = c.height;
  ctx.clearRect(0, 0, W, H);
  ctx.fillStyle = "#10131a"; ctx.fillRect(0, 0, W, H);
  if (times.length < 1) return;
  const [t0, span] = sparkSpan(times);
  let hi = 0;
  for (const l of lines) for (const v of l.values) if (v !== null && v > hi) hi = v;
  hi = hi > 0 ? hi * 1.1 : 1;
  c.dataset.max = String(hi);
  for (const l of lines) {
    ctx.strokeStyle = l.color; ctx.lineWidth = 1.5;
    ctx.beginPath();
    let pen = false;
    l.values.forEach((v, i) => {
      if (v === null) { pen = false; return; }
      const x = (times[i] - t0) / span * (W - 2) + 1, y = H - 2 - v / hi * (H - 4);
      if (pen) ctx.lineTo(x, y); else ctx.moveTo(x, y);
      pen = true;
    });
    ctx.stroke();
  }
}

function hoverSpark(key, c, ev) {
  const h = state.history;
  if (!h.length) return;
  const r = c.getBoundingClientRect();
  const t1 = h[h.length - 1].time;
  const [t0, span] = sparkSpan(h.map((p) => p.time));
  const t = t0 + (ev.clientX - r.left) / r.width * span;
  let p = h[0];
  for (const q of h) if (Math.abs(q.time - t) < Math.abs(p.time - t)) p = q;
  const ago = `${Math.round(t1 - p.time)} s ago`;
  const fmt = (v) => (v === null || v === undefined ? "n/a" : (Math.round(v * 10) / 10).toString());
  const text = key === "latency"
    ? Object.entries(p.latency).map(([k, v]) => `expert ${k}: ${fmt(v)} ms`).join("\n")
    : `${key === "rows" ? "rows/s" : "queued jobs"}: ${fmt(p[key])}`;
  showTip(ev, `${ago}\n${text}`);
}

// Coordinator status fields shown first; the rest go under "more".
const COORD_MAIN = ["active_jobs", "queued_jobs", "active_rows", "rows_per_s", "tick_ms_p50", "jobs_done",
                    "unavailable_experts", "queue_depth"];

function kvTable(obj) {
  const t = el("table");
  for (const [k, v] of Object.entries(obj)) {
    const text = Array.isArray(v) ? (v.length ? v.join(", ") : "none")
      : typeof v === "object" ? JSON.stringify(v) : String(v);
    t.append(el("tr", {}, el("th", { text: k.replaceAll("_", " ") }), el("td", { class: "n", text })));
  }
  return t;
}

function renderLegend() {
  const box = $("#legend");
  box.replaceChildren();
  for (let k = 0; k < state.experts; k++) {
    const sw = el("span", { class: "swatch" });
    sw.style.background = expertColor(k);
    box.append(el("span", {}, sw, `expert ${k}`));
  }
  const mixed = el("span", { class: "swatch" });
  mixed.style.background = MIXED;
  box.append(el("span", {}, mixed, "several"));
}

function updateFleetAge() {
  if (!state.fleetTime) return;
  const age = Math.max(0, Date.now() / 1000 - state.fleetTime);
  $("#fleet-age").textContent = `updated ${age.toFixed(0)} s ago`;
}

// ------------------------------------------------------------------ start

document.addEventListener("DOMContentLoaded", () => {
  $("#gen-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const req = readForm();
    if (send(req)) state.pending.set(req.ref, req);
  });
  $("#strategy").addEventListener("change", () => { $("#topk-label").hidden = $("#strategy").value !== "topk"; });
  for (const id of ["digits", "count"]) {
    $(`#${id}`).addEventListener("focus", () => { $(`input[name=mode][value=${id}]`).checked = true; });
  }
  $("#clear").addEventListener("click", () => {
    for (const [id, job] of state.jobs) {
      if (job.state !== "running" && job.state !== "submitted") {
        stopPlay(job); job.card.remove(); state.jobs.delete(id);
      }
    }
  });
  renderLegend();
  setInterval(updateFleetAge, 1000);
  connect();
});
