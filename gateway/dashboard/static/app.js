// The dashboard page: polls /dashboard/api/state every second and redraws the tiles,
// the four charts (plain <canvas>, no library: the page works offline) and the table.
"use strict";

const POLL_MS = 1000;
const COLORS = {};  // read from the stylesheet once, so the colours live in one place

function css(name) {
  if (!(name in COLORS)) {
    COLORS[name] = getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  }
  return COLORS[name];
}

function text(id, value) {
  document.getElementById(id).textContent = value;
}

function ms(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const v = seconds * 1000;
  return v >= 100 ? v.toFixed(0) : v >= 10 ? v.toFixed(1) : v.toFixed(2);
}

// A canvas sized to its CSS box at the device's pixel ratio; returns its 2D context.
function surface(id) {
  const canvas = document.getElementById(id);
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * ratio)) canvas.width = Math.round(w * ratio);
  if (canvas.height !== Math.round(h * ratio)) canvas.height = Math.round(h * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, w, h);
  return { ctx, w, h };
}

const PAD = { left: 38, right: 6, top: 6, bottom: 16 };

// Axes with a "nice" top value; returns the function that maps a value to a y pixel.
function axes(s, max, windowS) {
  const { ctx, w, h } = s;
  const top = niceTop(max);
  ctx.strokeStyle = css("--line");
  ctx.fillStyle = css("--muted");
  ctx.font = "10px system-ui, sans-serif";
  ctx.lineWidth = 1;
  for (let i = 0; i <= 2; i++) {
    const y = PAD.top + (h - PAD.top - PAD.bottom) * (1 - i / 2);
    ctx.beginPath(); ctx.moveTo(PAD.left, y + 0.5); ctx.lineTo(w - PAD.right, y + 0.5); ctx.stroke();
    const label = top * i / 2;
    ctx.fillText(label >= 10 ? label.toFixed(0) : label.toFixed(1), 2, y + 3);
  }
  ctx.fillText(`-${Math.round(windowS / 60)} min`, PAD.left, h - 3);
  ctx.fillText("now", w - PAD.right - 18, h - 3);
  return (v) => PAD.top + (h - PAD.top - PAD.bottom) * (1 - Math.min(v / top, 1));
}

function niceTop(max) {
  if (!(max > 0)) return 1;
  const p = Math.pow(10, Math.floor(Math.log10(max)));
  for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= max) return m * p;
  return 10 * p;
}

function slot(s, n, i) {
  const width = (s.w - PAD.left - PAD.right) / n;
  return { x: PAD.left + i * width, width };
}

// Stacked bars: series = [[colorVar, valueOf(bucket)], ...], bottom first.
function bars(id, buckets, series, windowS) {
  const s = surface(id);
  const totals = buckets.map((b) => series.reduce((t, [, f]) => t + f(b), 0));
  const y = axes(s, Math.max(...totals), windowS);
  buckets.forEach((b, i) => {
    const { x, width } = slot(s, buckets.length, i);
    let base = 0;
    for (const [color, f] of series) {
      const v = f(b);
      if (v <= 0) continue;
      s.ctx.fillStyle = css(color);
      s.ctx.fillRect(x + 0.5, y(base + v), Math.max(width - 1, 1), y(base) - y(base + v));
      base += v;
    }
  });
}

// One line per percentile; a bucket without requests leaves a gap.
function lines(id, buckets, key, windowS) {
  const s = surface(id);
  const values = buckets.flatMap((b) => (b[key] ? [b[key].p99 * 1000] : []));
  const y = axes(s, Math.max(0, ...values), windowS);
  for (const [p, color] of [["p50", "--p50"], ["p90", "--p90"], ["p99", "--p99"]]) {
    s.ctx.strokeStyle = css(color);
    s.ctx.fillStyle = css(color);
    s.ctx.lineWidth = 1.6;
    s.ctx.beginPath();
    let open = false;
    buckets.forEach((b, i) => {
      const { x, width } = slot(s, buckets.length, i);
      if (!b[key]) { open = false; return; }
      const px = x + width / 2, py = y(b[key][p] * 1000);
      if (open) s.ctx.lineTo(px, py); else s.ctx.moveTo(px, py);
      s.ctx.fillRect(px - 1.5, py - 1.5, 3, 3);
      open = true;
    });
    s.ctx.stroke();
  }
}

function cell(row, value, cls) {
  const td = row.insertCell();
  if (value instanceof Node) td.appendChild(value); else td.textContent = value;
  if (cls) td.className = cls;
  return td;
}

function kvCell(inst) {
  if (!inst.total_kv_blocks) return "–";  // no KV cache (gateway, encoder, cache service)
  const span = document.createElement("span");
  const used = 1 - inst.free_kv_blocks / inst.total_kv_blocks;
  const bar = document.createElement("span");
  bar.className = "bar";
  const fill = document.createElement("span");
  fill.style.width = `${(used * 100).toFixed(0)}%`;
  bar.appendChild(fill);
  span.append(bar, `${inst.free_kv_blocks} / ${inst.total_kv_blocks}`);
  return span;
}

function table(instances) {
  const body = document.querySelector("#instances tbody");
  body.replaceChildren();
  for (const inst of instances) {
    const row = body.insertRow();
    row.className = inst.state === "gone" ? "gone" : "";
    row.dataset.instance = inst.id;
    const state = document.createElement("span");
    state.className = `state state-${inst.state.replace(" ", ".")}`;
    state.textContent = inst.state;
    cell(row, inst.role);
    cell(row, inst.id, "instance-id");
    const model = inst.model || "–";
    cell(row, model.length > 20 ? `${model.slice(0, 12)}…` : model).title = model;
    cell(row, state);
    cell(row, inst.running);
    cell(row, inst.waiting);
    cell(row, inst.inflight === null ? "–" : inst.inflight);
    cell(row, kvCell(inst));
    cell(row, `${inst.heartbeat_age_s.toFixed(1)} s ago`);
  }
  const live = instances.filter((i) => i.state !== "gone").length;
  text("instance-count", `${live} live, ${instances.length - live} gone`);
}

function tiles(stats) {
  const t = stats.totals;
  const recent = stats.buckets.slice(-Math.max(1, Math.round(30 / stats.bucket_s)));
  const span = recent.reduce((s, b) => s + b.span_s, 0);
  const count = recent.reduce((s, b) => s + b.requests, 0);
  text("total-requests", t.requests);
  text("rate", span > 0 ? (count / span).toFixed(2) : "0");
  text("errors", t.errors);
  text("ttft-p50", t.ttft ? `${ms(t.ttft.p50)} / ${ms(t.ttft.p99)} ms` : "–");
  text("tpot-p50", t.tpot ? `${ms(t.tpot.p50)} / ${ms(t.tpot.p99)} ms` : "–");
  text("hit-rate", t.hit_rate === null ? "–" : `${(t.hit_rate * 100).toFixed(0)} %`);
}

function render(state) {
  const stats = state.stats;
  text("model", state.model);
  text("mode", state.mode);
  text("updated", `updated ${new Date().toLocaleTimeString()}`);
  text("window-note", `Charts: this gateway's requests in ${stats.bucket_s} s buckets over ` +
    `${stats.window_s / 60} min. Instances: heartbeats; "gone" rows stay about a minute.`);
  tiles(stats);
  const b = stats.buckets, win = stats.window_s;
  bars("chart-rate", b, [["--req", (x) => (x.requests - x.errors) / x.span_s],
    ["--err", (x) => x.errors / x.span_s]], win);
  lines("chart-ttft", b, "ttft", win);
  lines("chart-tpot", b, "tpot", win);
  bars("chart-cache", b, [["--exact", (x) => x.cache["hit-exact"]],
    ["--sem", (x) => x.cache["hit-semantic"]], ["--miss", (x) => x.cache.miss],
    ["--off", (x) => x.cache.off]], win);
  table(state.instances);
}

// The semantic router's last decisions (GET /dashboard/api/router); hidden without one.
function decisions(doc) {
  document.getElementById("router").hidden = !doc.enabled;
  if (!doc.enabled) return;
  const body = document.querySelector("#decisions tbody");
  body.replaceChildren();
  for (const d of doc.decisions) {
    const row = body.insertRow();
    cell(row, new Date(d.at * 1000).toLocaleTimeString());
    cell(row, d.requested || "(default)");
    cell(row, d.route);
    cell(row, d.model);
    cell(row, d.signals.join(", "));
    cell(row, d.guard_reason.length ? `${d.guard} (${d.guard_reason.join(", ")})` : d.guard,
      d.guard.startsWith("block") ? "guard-block" : "");
    cell(row, d.ms.toFixed(2));
  }
  const parts = Object.entries(doc.routes).map(([k, v]) => `${k} ${v}`);
  text("router-totals", `last ${doc.decisions.length}: ${parts.join(", ")}`);
}

async function poll() {
  try {
    const response = await fetch("/dashboard/api/state", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
    const routed = await fetch("/dashboard/api/router", { cache: "no-store" });
    if (routed.ok) decisions(await routed.json());
  } catch (err) {
    text("updated", `gateway unreachable (${err.message}); retrying`);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

poll();
