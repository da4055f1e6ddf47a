// fleetrl dashboard: polls /api/state (coordinator/dashboard.py) and draws line and bar charts on
// canvases. Plain JS, no libraries: the coordinator may run where nothing can be downloaded.
// The time window: the whole run (default), the last N seconds (follows the run), or a fixed range picked by
// dragging across a chart. It lives in the URL's hash (#all, #last=600, #from=..&to=..) so a view can be shared.
"use strict";

const POLL_MS = 1000;
const COLORS = ["#2b6cb0", "#d9480f", "#2f9e44", "#ae3ec9", "#0c8599", "#e8590c", "#5c7cfa", "#c2255c"];
const MARGIN = { left: 54, right: 12, top: 8, bottom: 22 };
const cards = new Map();
let selection = parseHash(window.location.hash);
let lastNowS = Date.now() / 1000;
let pollTimer = null;

function parseHash(hash) {
  const params = new URLSearchParams(hash.replace(/^#/, ""));
  const from = Number(params.get("from")), to = Number(params.get("to")), last = Number(params.get("last"));
  if (params.has("from") && params.has("to") && isFinite(from) && isFinite(to) && from < to) {
    return { mode: "fixed", from, to };
  }
  if (params.has("last") && last > 0) return { mode: "last", seconds: last };
  return { mode: "all" };
}

function selectionHash(sel) {
  if (sel.mode === "fixed") return "#from=" + sel.from.toFixed(3) + "&to=" + sel.to.toFixed(3);
  return sel.mode === "last" ? "#last=" + sel.seconds : "#all";
}

function stateUrl(sel) {
  if (sel.mode === "fixed") return "/api/state?from=" + sel.from + "&to=" + sel.to;
  if (sel.mode === "last") return "/api/state?from=" + (lastNowS - sel.seconds);
  return "/api/state";
}

function select(sel) {
  selection = sel;
  history.replaceState(null, "", selectionHash(sel));
  renderRangeBar(null);
  clearTimeout(pollTimer);
  poll();  // at once, not at the next tick
}

function fmt(value) {
  if (value === null || value === undefined || !isFinite(value)) return "-";
  const abs = Math.abs(value);
  if (abs >= 1e6) return (value / 1e6).toFixed(2) + "M";
  if (abs >= 1e4) return (value / 1e3).toFixed(1) + "k";
  if (abs >= 100) return value.toFixed(0);
  if (abs >= 1) return value.toFixed(2);
  if (abs === 0) return "0";
  return value.toPrecision(3);
}

function fmtAge(seconds) {
  if (seconds < 0) seconds = 0;
  if (seconds < 90) return seconds.toFixed(1) + " s ago";
  if (seconds < 5400) return (seconds / 60).toFixed(1) + " min ago";
  return (seconds / 3600).toFixed(1) + " h ago";
}

function fmtClock(seconds, spanS) {
  const date = new Date(seconds * 1000), pad = (n) => String(n).padStart(2, "0");
  const hm = pad(date.getHours()) + ":" + pad(date.getMinutes());
  if (spanS < 600) return hm + ":" + pad(date.getSeconds());
  if (spanS < 3 * 86400) return hm;
  return (date.getMonth() + 1) + "/" + date.getDate() + " " + hm;
}

function fmtSpan(seconds) {
  if (seconds < 120) return seconds.toFixed(0) + " s";
  if (seconds < 7200) return (seconds / 60).toFixed(1) + " min";
  return (seconds / 3600).toFixed(1) + " h";
}

function el(tag, attrs, text) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
  if (text !== undefined) node.textContent = text;
  return node;
}

// Ticks at 1, 2 or 5 times a power of ten, so axis labels stay short and round.
function niceTicks(lo, hi, count) {
  if (hi - lo < 1e-12) { const pad = Math.abs(hi) * 0.1 || 1; lo -= pad; hi += pad; }
  const raw = (hi - lo) / count;
  const power = Math.pow(10, Math.floor(Math.log10(raw)));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw);
  const start = Math.floor(lo / step) * step;
  const ticks = [];
  for (let i = 0; ; i++) {  // up to the first tick at or above hi: no line leaves the plot at the top
    const tick = Number((start + i * step).toPrecision(12));
    ticks.push(tick);
    if (tick >= hi - step * 1e-9) break;
  }
  return ticks;
}

function setupCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.font = "11px 'DejaVu Sans', sans-serif";
  return { ctx, width, height };
}

function drawNoData(ctx, width, height) {
  ctx.fillStyle = "#a3acb6";
  ctx.textAlign = "center";
  ctx.textBaseline = "middle";
  ctx.font = "italic 13px 'DejaVu Sans', sans-serif";
  ctx.fillText("no data", width / 2, height / 2);
}

// Axis labels carry only the decimals the tick step needs ("4", "0.25"), unlike the legend values.
function fmtTick(value, step) {
  if (Math.abs(value) >= 1e4) return fmt(value);
  const decimals = Math.max(0, Math.min(6, -Math.floor(Math.log10(step) + 1e-9)));
  return value.toFixed(decimals);
}

function drawYAxis(ctx, ticks, yOf, width) {
  const step = ticks.length > 1 ? ticks[1] - ticks[0] : 1;
  ctx.strokeStyle = "#e6e9ee";
  ctx.fillStyle = "#65707d";
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  for (const tick of ticks) {
    const y = Math.round(yOf(tick)) + 0.5;
    ctx.beginPath(); ctx.moveTo(MARGIN.left, y); ctx.lineTo(width - MARGIN.right, y); ctx.stroke();
    ctx.fillText(fmtTick(tick, step), MARGIN.left - 6, y);
  }
}

function drawLineChart(card, lines, window_) {
  const { ctx, width, height } = setupCanvas(card.canvas);
  const all = lines.flatMap((line) => line.points.filter((p) => p[1] !== null));
  let x0 = window_.from_s, x1 = window_.to_s;
  if (!Number.isFinite(x0) || !Number.isFinite(x1)) { x0 = lastNowS - 60; x1 = lastNowS; }  // null: no data yet
  if (x1 - x0 < 1) x0 = x1 - 1;
  const plotW = width - MARGIN.left - MARGIN.right, plotH = height - MARGIN.top - MARGIN.bottom;
  card.timeOf = (px) => x0 + ((px - MARGIN.left) / plotW) * (x1 - x0);  // for a drag across the chart
  if (all.length === 0) { drawNoData(ctx, width, height); return; }
  const ticks = niceTicks(Math.min(...all.map((p) => p[1])), Math.max(...all.map((p) => p[1])), 4);
  const y0 = ticks[0], y1 = ticks[ticks.length - 1];
  const xOf = (t) => MARGIN.left + ((t - x0) / (x1 - x0)) * plotW;
  const yOf = (v) => MARGIN.top + (1 - (v - y0) / (y1 - y0)) * plotH;
  drawYAxis(ctx, ticks, yOf, width);
  ctx.fillStyle = "#65707d";
  ctx.textBaseline = "top";
  for (let i = 0; i <= 3; i++) {  // x labels: wall-clock time across the window
    const t = x0 + ((x1 - x0) * i) / 3;
    ctx.textAlign = i === 0 ? "left" : i === 3 ? "right" : "center";
    ctx.fillText(fmtClock(t, x1 - x0), xOf(t), height - MARGIN.bottom + 6);
  }
  ctx.save();
  ctx.beginPath(); ctx.rect(MARGIN.left, 0, plotW, height); ctx.clip();  // points just outside the window
  lines.forEach((line, index) => {
    const color = COLORS[index % COLORS.length];
    ctx.strokeStyle = color; ctx.fillStyle = color; ctx.lineWidth = 1.6;
    ctx.beginPath();
    let pen = false, last = null;
    for (const [t, v] of line.points) {
      if (v === null) { pen = false; continue; }  // a gap (NaN reported): break the line
      if (pen) ctx.lineTo(xOf(t), yOf(v)); else ctx.moveTo(xOf(t), yOf(v));
      pen = true; last = [t, v];
    }
    ctx.stroke();
    if (last) { ctx.beginPath(); ctx.arc(xOf(last[0]), yOf(last[1]), 2.6, 0, 2 * Math.PI); ctx.fill(); }
  });
  ctx.restore();
}

function drawBarChart(canvas, bins) {
  const { ctx, width, height } = setupCanvas(canvas);
  if (bins.length === 0) { drawNoData(ctx, width, height); return; }
  const maxSteps = Math.max(...bins.map((b) => b[0]));
  const counts = new Map(bins.map((b) => [b[0], b[1]]));
  const ticks = niceTicks(0, Math.max(...bins.map((b) => b[1])), 4);
  const top = ticks[ticks.length - 1];
  const plotW = width - MARGIN.left - MARGIN.right, plotH = height - MARGIN.top - MARGIN.bottom;
  const yOf = (v) => MARGIN.top + (1 - v / top) * plotH;
  drawYAxis(ctx, ticks, yOf, width);
  const slot = plotW / (maxSteps + 1);
  ctx.textAlign = "center";
  for (let steps = 0; steps <= maxSteps; steps++) {
    const count = counts.get(steps) || 0, x = MARGIN.left + steps * slot;
    ctx.fillStyle = COLORS[0];
    ctx.fillRect(x + slot * 0.15, yOf(count), slot * 0.7, yOf(0) - yOf(count));
    ctx.fillStyle = "#65707d";
    ctx.textBaseline = "top";
    ctx.fillText(String(steps), x + slot / 2, height - MARGIN.bottom + 6);
  }
}

function ensureCard(id, title, unit) {
  if (cards.has(id)) return cards.get(id);
  const section = el("section", { class: "card", id: "chart-" + id, "data-has-data": "false" });
  const heading = el("h2", {}, title);
  if (unit) heading.appendChild(el("span", { class: "unit" }, unit));
  const note = el("p", { class: "note" });
  const plot = el("div", { class: "plot" });
  const canvas = el("canvas");
  const brush = el("div", { class: "brush" });
  plot.append(canvas, brush);
  const legend = el("ul", { class: "legend" });
  section.append(heading, note, plot, legend);
  document.getElementById("charts").appendChild(section);
  const card = { section, note, canvas, brush, legend, timeOf: null };
  enableDragZoom(card);
  cards.set(id, card);
  return card;
}

// A drag across a chart selects that time range for every chart (a fixed window; "whole run" goes back).
function enableDragZoom(card) {
  let startX = null;
  const xIn = (event) => event.clientX - card.canvas.getBoundingClientRect().left;
  card.canvas.addEventListener("mousedown", (event) => {
    if (!card.timeOf) return;
    startX = xIn(event);
    Object.assign(card.brush.style, { display: "block", left: startX + "px", width: "0px" });
  });
  window.addEventListener("mousemove", (event) => {
    if (startX === null) return;
    const x = Math.max(0, Math.min(card.canvas.clientWidth, xIn(event)));
    Object.assign(card.brush.style, { left: Math.min(x, startX) + "px", width: Math.abs(x - startX) + "px" });
  });
  window.addEventListener("mouseup", (event) => {
    if (startX === null) return;
    const endX = xIn(event), from = card.timeOf(Math.min(startX, endX)), to = card.timeOf(Math.max(startX, endX));
    startX = null;
    card.brush.style.display = "none";
    if (to - from > 0.5) select({ mode: "fixed", from, to });  // a click is not a zoom
  });
}

function renderLegend(card, lines) {
  card.legend.replaceChildren();
  if (lines.length === 0) card.legend.appendChild(el("li", { class: "empty" }, "no data"));
  lines.forEach((line, index) => {
    const item = el("li");
    const swatch = el("span", { class: "swatch" });
    swatch.style.background = COLORS[index % COLORS.length];
    const hasData = line.latest !== null;
    const latest = el("span", { class: hasData ? "latest" : "latest nodata", "data-series": line.series },
      hasData ? fmt(line.latest) : "no data");
    item.append(swatch, el("span", { class: "label" }, line.label), latest);
    card.legend.appendChild(item);
  });
}

function renderCharts(state) {
  state.charts.forEach((chart, index) => {
    const card = ensureCard(chart.id, chart.title, chart.unit);
    const numPoints = chart.lines.reduce((sum, line) => sum + line.points.length, 0);
    card.section.setAttribute("data-has-data", String(numPoints > 0));
    card.section.setAttribute("data-num-points", String(numPoints));
    drawLineChart(card, chart.lines, state.window);
    renderLegend(card, chart.lines);
    if (index === 0) ensureCard("staleness_hist", "Staleness distribution", "steps");  // placed after the reward
  });
  const hist = state.staleness_hist;
  const card = cards.get("staleness_hist");
  card.section.setAttribute("data-has-data", String(hist.bins.length > 0));
  card.note.textContent = hist.source;
  drawBarChart(card.canvas, hist.bins);
  card.legend.replaceChildren(...hist.bins.map(([steps, count]) =>
    el("li", { "data-staleness": String(steps) }, steps + " steps: " + Math.round(count))));
}

function renderServers(state) {
  const body = document.querySelector("#servers tbody");
  if (state.servers.length === 0) {
    body.replaceChildren(el("tr", {}, ""));
    body.firstChild.appendChild(el("td", { class: "empty", colspan: "12" }, "no data"));
    return;
  }
  body.replaceChildren(...state.servers.map((server) => {
    const row = el("tr", { "data-server-id": server.server_id });
    const live = server.live || {};  // the server's own reports (rollout metrics stream)
    const has = (key) => live[key] !== undefined && live[key] !== null;
    const cell = (key, format) => el("td", { "data-live": key }, has(key) ? format(live[key]) : "-");
    const update = has("weight_update_s")
      ? fmt(live.weight_update_s) + " s (" + [live.weight_receive_s, live.weight_load_s, live.weight_paused_s]
        .map(fmt).join(" / ") + ")"
      : server.update_s ? fmt(server.update_s) + " s (paused " + fmt(server.paused_s) + ")" : "-";
    const age = has("age_s") ? Math.min(live.age_s, server.age_s) : server.age_s;
    row.append(el("td", {}, server.server_id), el("td", {}, server.address),
      el("td", { class: "version" }, "v" + server.policy_version),
      el("td", {}, server.lag_versions === null ? "-" : String(server.lag_versions)),
      el("td", { class: "status-" + server.status }, server.status),
      cell("tokens_per_s", fmt), cell("requests_running", fmt), cell("requests_waiting", fmt),
      cell("kv_cache_usage", (v) => (100 * v).toFixed(1) + "%"),
      el("td", { "data-live": "weight_update" }, update),
      el("td", {}, server.message || ""), el("td", { class: "age" }, fmtAge(age)));
    return row;
  }));
}

function renderRangeBar(window_) {
  for (const button of document.querySelectorAll("#range button")) {
    const range = button.getAttribute("data-range");
    const active = selection.mode === "all"
      ? range === "all"
      : selection.mode === "last" && Number(range) === selection.seconds;
    button.classList.toggle("active", active);
  }
  if (!window_) return;
  const label = document.getElementById("range-label");
  const known = Number.isFinite(window_.from_s) && Number.isFinite(window_.to_s);  // null before any report
  const span = known ? window_.to_s - window_.from_s : NaN;
  label.textContent = Number.isFinite(span)
    ? fmtClock(window_.from_s, span) + " - " + fmtClock(window_.to_s, span) + " (" + fmtSpan(span) + ")"
    : "no data yet";
  document.body.setAttribute("data-window-from", String(window_.from_s));
  document.body.setAttribute("data-window-to", String(window_.to_s));
  document.body.setAttribute("data-selection", selection.mode);
}

function renderHeader(state) {
  document.getElementById("run-id").textContent = state.run_id;
  const version = state.trainer_version;
  document.getElementById("trainer-version").textContent = version === null ? "-" : "v" + version;
  const roles = document.getElementById("roles");
  roles.replaceChildren(...Object.entries(state.roles).map(([role, info]) => {
    if (info === null) return el("span", { class: "role nodata", "data-role": role }, role + ": no data");
    const text = info.done ? role + ": done" : role + ": step " + info.step + ", " + fmtAge(info.age_s);
    return el("span", { class: "role", "data-role": role }, text);
  }));
}

function setStatus(text, isError) {
  const status = document.getElementById("status");
  status.textContent = text;
  status.className = isError ? "error" : "";
}

async function poll() {
  try {
    const response = await fetch(stateUrl(selection), { cache: "no-store" });
    const state = await response.json();
    if (!response.ok) throw new Error(state.error || response.statusText);
    lastNowS = state.now_s;
    renderHeader(state);
    renderRangeBar(state.window);
    renderCharts(state);
    renderServers(state);
    document.body.setAttribute("data-updated", String(state.now_s));
    setStatus("updated " + new Date().toLocaleTimeString(), false);
  } catch (error) {
    setStatus("dashboard: " + (error.message || error), true);  // keep the last charts on screen
  } finally {
    clearTimeout(pollTimer);
    pollTimer = setTimeout(poll, POLL_MS);
  }
}

for (const button of document.querySelectorAll("#range button")) {
  button.addEventListener("click", () => {
    const range = button.getAttribute("data-range");
    select(range === "all" ? { mode: "all" } : { mode: "last", seconds: Number(range) });
  });
}
poll();
