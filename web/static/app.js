// ddm-fleet web viewer. Plain JS, no build step. Protocol: web/protocol.py.
"use strict";

const PALETTE = ["#e6194b", "#3cb44b", "#4363d8", "#f58231", "#911eb4", "#42d4f4", "#f032e6", "#bfef45",
                 "#fabed4", "#469990", "#dcbeff", "#9a6324"];
const MIXED = "#9aa0aa";
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
  jobs: new Map(),      // job_id -> {card, tiles: [{canvas, bars, label}], steps, frames, digits, state}
  pending: new Map(),   // ref -> request summary, until accepted / rejected
  nextRef: 1,
  retryMs: 500,
  token: null,          // the viewer's token, when it needs one (URL fragment #token=...)
  experts: 0,           // K, learned from weights and the fleet panel
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

// ------------------------------------------------------------------ jobs

function jobCard(jobId, digits) {
  let job = state.jobs.get(jobId);
  if (job) return job;
  const card = $("#job-template").content.firstElementChild.cloneNode(true);
  card.dataset.jobId = jobId;
  card.dataset.frames = "0";
  $(".job-title", card).textContent = jobId;
  job = { id: jobId, card, tiles: [], steps: 0, frames: 0, digits: digits || [], state: "submitted" };
  $(".cancel", card).onclick = () => send({ type: "cancel", job_id: jobId });
  $(".download-all", card).onclick = () => downloadAll(job);
  $("#empty-hint").hidden = true;
  $("#jobs").prepend(card);
  state.jobs.set(jobId, job);
  if (job.digits.length) ensureTiles(job, job.digits.length);
  return job;
}

function ensureTiles(job, n) {
  const box = $(".tiles", job.card);
  while (job.tiles.length < n) {
    const i = job.tiles.length;
    const canvas = el("canvas", { width: 32, height: 32, "data-expert": "" });
    const bars = el("div", { class: "bars" });
    const digit = job.digits[i];
    const label = el("div", { class: "label" }, el("span", { text: digit === undefined ? `#${i}` : `digit ${digit}` }));
    box.append(el("div", { class: "tile" }, canvas, bars, label));
    job.tiles.push({ canvas, bars, label, link: null });
  }
}

function setJobState(job, s, text) {
  job.state = s;
  job.card.dataset.state = s;
  if (text !== undefined) $(".job-status", job.card).textContent = text;
  const finished = s !== "running" && s !== "submitted";
  $(".cancel", job.card).hidden = finished;
}

function drawTile(canvas, b64, h, w) {
  if (canvas.width !== w || canvas.height !== h) { canvas.width = w; canvas.height = h; }
  const bin = atob(b64);
  const ctx = canvas.getContext("2d");
  const img = ctx.createImageData(w, h);
  const n = Math.min(bin.length, w * h);
  for (let i = 0; i < n; i++) {
    const v = bin.charCodeAt(i);
    img.data[4 * i] = v; img.data[4 * i + 1] = v; img.data[4 * i + 2] = v; img.data[4 * i + 3] = 255;
  }
  ctx.putImageData(img, 0, 0);
}

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

function onFrame(msg) {
  const job = jobCard(msg.job_id);
  if (job.state !== "running" && job.state !== "submitted") return;
  ensureTiles(job, msg.tiles.length);
  const [h, w] = msg.size;
  msg.tiles.forEach((b64, i) => {
    const tile = job.tiles[i];
    drawTile(tile.canvas, b64, h, w);
    const e = msg.experts[i];
    tile.canvas.dataset.expert = String(e);
    tile.canvas.style.borderColor = expertColor(e);
    tile.canvas.title = e >= 0 ? `step ${msg.step}: expert ${e}` : `step ${msg.step}: several experts`;
    drawBars(tile.bars, msg.weights[i]);
  });
  job.steps = msg.steps;
  job.frames += 1;
  job.card.dataset.frames = String(job.frames);
  job.card.dataset.step = String(msg.step);
  if (job.frames === 1) job.card.dataset.firstStep = String(msg.step);
  $("progress", job.card).value = msg.steps ? msg.step / msg.steps : 0;
  setJobState(job, "running", `step ${msg.step}/${msg.steps} · t=${msg.t.toFixed(2)}`);
  if (msg.notes && msg.notes.length) $(".job-notes", job.card).textContent = msg.notes.join("; ");
}

function onDone(msg) {
  const job = jobCard(msg.job_id, msg.digits);
  if (!job.digits.length) job.digits = msg.digits;
  ensureTiles(job, msg.tiles.length);
  const [h, w] = msg.size;
  msg.tiles.forEach((b64, i) => {
    const tile = job.tiles[i];
    drawTile(tile.canvas, b64, h, w);
    tile.canvas.dataset.final = "1";
    if (msg.usage && msg.usage[i]) {
      drawBars(tile.bars, msg.usage[i]);
      tile.bars.title = "share of steps per expert: " + msg.usage[i].map((u, k) => `expert ${k} ${u.toFixed(2)}`).join(", ");
    }
    if (!tile.link) {
      const digit = msg.digits[i];
      tile.link = el("a", { href: "#", class: "download", text: "PNG", title: "download this image",
                            download: `ddm-${msg.job_id}-${i}-digit${digit}.png` });
      tile.link.onclick = () => { tile.link.href = pngURL([tile.canvas], 4); };
      tile.label.append(tile.link);
    }
  });
  $("progress", job.card).value = 1;
  $(".download-all", job.card).hidden = false;
  setJobState(job, "done", `done: ${msg.steps} steps, ${msg.strategy}, ${msg.elapsed_s.toFixed(2)} s`);
  if (msg.notes && msg.notes.length) $(".job-notes", job.card).textContent = msg.notes.join("; ");
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

function downloadAll(job) {
  const a = el("a", { href: pngURL(job.tiles.map((t) => t.canvas), 4), download: `ddm-${job.id}.png` });
  document.body.append(a); a.click(); a.remove();
}

const HANDLERS = {
  hello: (msg) => { state.limits = msg; },
  pong: () => {},
  accepted: (msg) => {
    const req = state.pending.get(msg.ref);
    state.pending.delete(msg.ref);
    const job = jobCard(msg.job_id, msg.digits);
    if (req) {
      const routing = req.strategy === "topk" ? `top-${req.top_k}` : req.strategy;
      $(".job-notes", job.card).textContent = `${req.steps} steps · ${routing} · ${req.solver}`;
    }
    if (!job.digits.length) { job.digits = msg.digits; }
    ensureTiles(job, msg.digits.length);
    job.tiles.forEach((t, i) => { $("span", t.label).textContent = `digit ${msg.digits[i]}`; });
    $(".job-title", job.card).textContent = `${msg.digits.length} image${msg.digits.length === 1 ? "" : "s"} · seed ${msg.seed}`;
    $(".job-title", job.card).title = msg.job_id;
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
  if (mode === "digits") req.digits = $("#digits").value;
  else req.count = numberOrText($("#count"));
  req.steps = numberOrText($("#steps"));
  req.solver = $("#solver").value;
  req.strategy = $("#strategy").value;
  if (req.strategy === "topk") req.top_k = numberOrText($("#top_k"));
  const seed = $("#seed").value.trim();
  if (seed !== "") req.seed = seed;  // as text: seeds reach 2**63, JS numbers are exact to 2**53
  return req;
}

// Numbers go as numbers; anything else goes as typed so the server can say what is wrong with it.
function numberOrText(input) {
  const raw = input.value.trim();
  if (raw === "" && input.validity && input.validity.badInput) return "(not a number)";
  const n = Number(raw);
  return raw !== "" && Number.isFinite(n) ? n : raw;
}

// ------------------------------------------------------------------ fleet panel

function renderFleet(msg) {
  const box = $("#fleet-experts");
  box.replaceChildren();
  if (!msg.experts.length) box.append(el("p", { class: "hint", text: "no expert workers discovered" }));
  for (const ex of msg.experts) {
    state.experts = Math.max(state.experts, ex.expert + 1);
    const table = el("table", {}, el("tr", {}, ...["worker", "backend", "device", "rows/s", "reqs"].map((h) => el("th", { text: h }))));
    for (const w of ex.workers) {
      const rate = w.rows_per_s === null || w.rows_per_s === undefined ? "…" : `${w.rows_per_s}${w.rate_unit === "req/s" ? " req" : ""}`;
      table.append(el("tr", { class: "worker", "data-worker-id": w.id },
        el("td", { text: w.id.slice(-8), title: `${w.name} ${w.version} ${w.host || ""}`.trim() }),
        el("td", { text: w.backend || "?" }), el("td", { text: w.device || "?" }),
        el("td", { class: "n", text: rate }), el("td", { class: "n", text: w.requests ?? "" })));
    }
    const title = el("h4", {}, el("span", { class: "swatch" }), `expert ${ex.expert} · ${ex.workers.length} worker${ex.workers.length === 1 ? "" : "s"}`);
    title.firstChild.style.background = expertColor(ex.expert);
    box.append(el("div", { class: "expert", "data-expert": String(ex.expert) }, title, table));
  }
  const coord = $("#fleet-coordinator");
  coord.replaceChildren();
  if (!msg.coordinator) coord.append(el("p", { class: "hint", text: "not answering" }));
  else {
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
  renderLegend();
  state.fleetTime = msg.time;
  updateFleetAge();
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
      if (job.state !== "running" && job.state !== "submitted") { job.card.remove(); state.jobs.delete(id); }
    }
  });
  renderLegend();
  setInterval(updateFleetAge, 1000);
  connect();
});
