// facecast web console: plain JS, no build step, no CDN (the lab machine may be offline).
// Data: GET /api/status once, then Server-Sent Events from /api/events; previews are JPEGs
// polled one after the other per camera (the next is asked for once the last has loaded).
"use strict";

const page = document.body.dataset.page;
const singleCamera = page === "camera" ? decodeURIComponent(location.pathname.split("/").pop()) : null;
const HISTORY_POINTS = 300;
let consoleInfo = null;
let history = {};

function el(tag, attrs = {}, text = "") {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
  if (text) node.textContent = text;
  return node;
}

function fmt(value, digits = 1) {
  return value === null || value === undefined ? "-" : Number(value).toFixed(digits);
}

// --- camera cards -------------------------------------------------------------------------------

function buildCards(cameras) {
  const container = document.getElementById("cameras");
  container.replaceChildren();
  for (const cameraId of cameras) {
    if (singleCamera !== null && cameraId !== singleCamera) continue;
    const card = el("div", {class: "card", id: `card-${cameraId}`});
    const title = el("h3");
    title.append(singleCamera ? el("span", {}, cameraId) : el("a", {href: `/camera/${encodeURIComponent(cameraId)}`}, cameraId));
    card.append(title);
    const img = el("img", {alt: `camera ${cameraId}`, "data-camera": cameraId});
    card.append(img);
    card.append(el("div", {class: "numbers", id: `numbers-${cameraId}`}));
    card.append(el("div", {class: "sparks", id: `sparks-${cameraId}`}));
    container.append(card);
    pollPreview(img, cameraId);
  }
}

// A preview is fetched, not put straight into img.src: its headers say which frame it shows
// (X-Frame-Seq, X-Capture-Ts-Lsl, X-Paired, X-Faces), and the <img> carries them as data-*
// attributes, for the title and for tests reading the page. They are set in the same task as the
// new src: while the new picture loads, img.complete is false (the old one is still shown), and
// once it is true the pixels and the data-* are the same frame's. Set after the load event
// instead, they lagged the pixels: the picture is complete before its load event runs, and a
// reader in between saw the new pixels under the old frame's number.
function pollPreview(img, cameraId) {
  const size = singleCamera ? "large" : "small";
  const intervalMs = 1000 / consoleInfo.preview_fps;
  let seq = 0;
  let shownUrl = null;
  const load = async () => {
    const started = performance.now();
    const mesh = document.getElementById("mesh-toggle").checked ? 1 : 0;
    let retryMs = 0;
    try {
      const response = await fetch(`/api/cameras/${encodeURIComponent(cameraId)}/preview.jpg?size=${size}&mesh=${mesh}&seq=${seq++}`);
      if (response.ok) {
        const url = URL.createObjectURL(await response.blob());
        await new Promise((resolve, reject) => {
          img.onload = resolve;
          img.onerror = reject;
          for (const [key, header] of [["frameSeq", "X-Frame-Seq"], ["captureTsLsl", "X-Capture-Ts-Lsl"], ["paired", "X-Paired"], ["faces", "X-Faces"]]) {
            img.dataset[key] = response.headers.get(header) ?? "";
          }
          img.title = `frame ${img.dataset.frameSeq}, captured at ${img.dataset.captureTsLsl} (LSL clock)`;
          img.src = url;
        });
        if (shownUrl !== null) URL.revokeObjectURL(shownUrl);
        shownUrl = url;
      } else {
        retryMs = 1000;  // 503 before the first frame (it says so in its body)
      }
    } catch (error) {
      retryMs = 1000;  // the console restarting, the network...
    }
    setTimeout(load, Math.max(retryMs, intervalMs - (performance.now() - started)));
  };
  load();
}

function renderCamera(cameraId, reports) {
  const box = document.getElementById(`numbers-${cameraId}`);
  if (!box) return;
  const capture = reports.find(r => r.source) || {};
  const output = reports.find(r => r.latency_ms) || {};
  const consumer = reports.find(r => r.transport && !r.source) || {};
  const rows = [
    ["published", `${fmt(output.fps)} fps`], ["captured", `${fmt(capture.fps)} fps`],
    ["faces", output.faces ?? "-"], ["skipped (newest-frame policy)", consumer.skipped ?? 0],
    ["transport", capture.transport || "-"],
    // The capture worker's decoder (Note [Decoder choice]), where the report carries it.
    ...(capture.decoder ? [["decoder", capture.decoder]] : []),
    ["capture→LSL p50/p99", output.latency_ms ? `${fmt(output.latency_ms.p50_ms, 0)} / ${fmt(output.latency_ms.p99_ms, 0)} ms` : "-"],
    ["source", capture.source || "?"],
  ];
  box.replaceChildren();
  for (const [label, value] of rows) {
    box.append(el("span", {}, label));
    box.append(el("span", label === "source" && value !== "ok" ? {class: "bad"} : {}, String(value)));
  }
  if (capture.fallback_reason) box.append(el("span", {class: "why"}, `why: ${capture.fallback_reason}`));
  if (capture.decode_reason) box.append(el("span", {class: "why"}, `decoder: ${capture.decode_reason}`));
  renderSparks(cameraId);
}

function sparkline(values, label) {
  const width = 140, height = 32;
  const wrap = el("div", {class: "spark"}, label);
  const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
  svg.setAttribute("width", width); svg.setAttribute("height", height);
  const finite = values.filter(v => v !== null && Number.isFinite(v));
  const max = Math.max(1e-9, ...finite);
  const points = values.map((v, i) => `${(i / Math.max(1, values.length - 1)) * width},${height - 2 - ((v ?? 0) / max) * (height - 4)}`);
  const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  line.setAttribute("points", points.join(" "));
  svg.append(line);
  wrap.append(svg);
  return wrap;
}

function renderSparks(cameraId) {
  const box = document.getElementById(`sparks-${cameraId}`);
  const points = history[`camera:${cameraId}`] || [];
  if (!box) return;
  box.replaceChildren(
    sparkline(points.map(p => p[1]), "fps"),
    sparkline(points.map(p => p[3]), "p99 ms"),
    sparkline(points.map(p => p[4]), "faces"));
}

// --- daemon-wide panels ---------------------------------------------------------------------------

function renderStatus(status) {
  if (!status) return;
  document.getElementById("daemon-line").textContent =
    `pid ${status.pid}, up ${fmt(status.uptime_s, 0)} s, ${status.ready ? "ready" : "starting"}`;
  for (const [cameraId, reports] of Object.entries(status.cameras)) renderCamera(cameraId, reports);
  const workers = document.getElementById("workers");
  if (workers) {
    workers.replaceChildren(rowOf(["worker", "state", "restarts", "uptime", "detail"], "th"));
    for (const w of status.workers) {
      const row = rowOf([w.name + (w.standby ? " (spare)" : ""), w.state, w.restarts, `${fmt(w.uptime_s, 0)} s`, w.detail || w.last_exit || ""]);
      if (!["running", "standby", "booting"].includes(w.state)) row.className = "bad";
      workers.append(row);
    }
  }
  const gpus = document.getElementById("gpus");
  if (gpus) {
    gpus.replaceChildren();
    if (!status.gpus.length) gpus.append(el("div", {}, `none (${status.gpu_note || "no NVIDIA GPU"})`));
    for (const gpu of status.gpus) {
      gpus.append(el("div", {}, `GPU ${gpu.index} ${gpu.name}: ${fmt(gpu.utilization_pct, 0)}% busy, ${fmt(gpu.memory_used_mib, 0)}/${fmt(gpu.memory_total_mib, 0)} MiB`));
      const points = history[`gpu:${gpu.index}`] || [];
      gpus.append(sparkline(points.map(p => p[1]), "utilisation %"));
    }
  }
  const stages = document.getElementById("stages");
  stages.replaceChildren(rowOf(["worker/stage", "p50", "p99", "count"], "th"));
  for (const [name, t] of Object.entries(status.stages).sort()) {
    if (singleCamera && !name.includes(singleCamera) && !name.startsWith("detection") && !name.startsWith("roi_landmark") && !name.startsWith("output")) continue;
    stages.append(rowOf([name, fmt(t.p50_ms), fmt(t.p99_ms), t.count]));
  }
}

function rowOf(cells, tag = "td") {
  const row = el("tr");
  for (const cell of cells) row.append(el(tag, {}, String(cell)));
  return row;
}

function addEvent(entry) {
  const list = document.getElementById("events");
  const fields = Object.entries(entry.event).filter(([k]) => k !== "event").map(([k, v]) => `${k}=${JSON.stringify(v)}`);
  list.prepend(el("li", {}, `${fmt(entry.ts_lsl, 3)}  ${entry.event.event}  ${fields.join(" ")}`));
  while (list.children.length > 200) list.lastChild.remove();
}

// --- control (only with web.allow_control; the token rides in the console's cookie) ---------------

async function post(action, body) {
  const response = await fetch(`/api/control/${action}`, {
    method: "POST", headers: {"Content-Type": "application/json"}, body: JSON.stringify(body || {}),
  });
  const text = await response.text();
  if (!response.ok) alert(`${action}: ${text}`);
}

function setUpControls() {
  const controls = document.getElementById("controls");
  if (!controls || !consoleInfo.allow_control) return;
  controls.hidden = false;
  document.getElementById("reload-button").onclick = () => post("reload");
  document.getElementById("stop-button").onclick = () => { if (confirm("Stop the daemon?")) post("stop"); };
  document.getElementById("marker-button").onclick = () => {
    const input = document.getElementById("marker-text");
    if (input.value.trim()) post("marker", {text: input.value});
    input.value = "";
  };
}

async function start() {
  const response = await fetch("/api/status");
  if (!response.ok) {
    document.getElementById("daemon-line").textContent = `console: ${await response.text()}`;
    return;
  }
  const snapshot = await response.json();
  consoleInfo = snapshot.console;
  history = snapshot.history;
  buildCards(consoleInfo.cameras);
  setUpControls();
  renderStatus(snapshot.status);
  for (const entry of snapshot.events) addEvent(entry);
  const events = new EventSource("/api/events");
  events.addEventListener("status", message => {
    const data = JSON.parse(message.data);
    for (const [key, point] of Object.entries(data.history_point)) {
      const points = history[key] || (history[key] = []);
      points.push(point);
      if (points.length > HISTORY_POINTS) points.shift();
    }
    renderStatus(data.status);
  });
  events.addEventListener("marker", message => addEvent(JSON.parse(message.data)));
  events.onerror = () => { document.getElementById("daemon-line").textContent = "reconnecting…"; };
}

start();
