// stealer dashboard: reads /events (Server-Sent Events, one JSON update per tick) and draws
// every panel on its own canvas or table. No library, no network beyond this server.
// The update's shape is stealer/dashboard/payload.py's docstring. History (for the time
// charts and the heat strip) is kept here, in the page: the server sends only the present.
"use strict";

const HISTORY = 480; // samples kept: 2 minutes at 4 Hz
const COLORS = ["#58a6ff", "#3fb950", "#f0883e", "#d2a8ff", "#ff7b72", "#79c0ff", "#e3b341",
  "#56d364"];
const MUTED = "#8b949e";
const GRID = "#30363d";

const state = {
  meta: null,
  last: null,
  updates: 0,
  hist: { t: [], rate: [], agentRate: [], queued: [], injector: [], pending: [], steals: [],
    attempts: [], deque: [], inbox: [], sm: [], migr: [], jlag: [] },
  sort: { key: "cpu_ms", dir: -1 },
  readyMs: null,
  slo: null,
};
window.stealerDashboard = state; // for the browser tests and for a curious console

// -- small helpers ---------------------------------------------------------------------

function $(id) { return document.getElementById(id); }

function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return e;
}

function fmtNum(x, digits) {
  if (x === null || x === undefined || Number.isNaN(x)) return "–";
  const a = Math.abs(x);
  if (a >= 1e9) return (x / 1e9).toFixed(2) + "G";
  if (a >= 1e6) return (x / 1e6).toFixed(2) + "M";
  if (a >= 1e4) return (x / 1e3).toFixed(1) + "k";
  if (digits !== undefined) return x.toFixed(digits);
  return a >= 100 || Number.isInteger(x) ? Math.round(x).toString() : x.toFixed(1);
}

function fmtNs(ns) {
  if (ns === null || ns === undefined) return "–";
  if (ns < 1e3) return ns.toFixed(0) + " ns";
  if (ns < 1e6) return (ns / 1e3).toPrecision(3) + " µs";
  if (ns < 1e9) return (ns / 1e6).toPrecision(3) + " ms";
  return (ns / 1e9).toPrecision(3) + " s";
}

function fmtDecade(d) { // 10**d ns as an axis label: 1 µs, 10 µs, 100 µs, 1 ms...
  const units = ["ns", "µs", "ms", "s"], u = Math.min(3, Math.max(0, Math.floor(d / 3)));
  return `${10 ** (d - 3 * u)} ${units[u]}`;
}

function fmtBytes(b) {
  if (b === null || b === undefined) return "–";
  if (b >= 2 ** 30) return (b / 2 ** 30).toFixed(2) + " GiB";
  if (b >= 2 ** 20) return (b / 2 ** 20).toFixed(1) + " MiB";
  return (b / 1024).toFixed(0) + " KiB";
}

function fmtUptime(s) {
  s = Math.floor(s || 0);
  const h = Math.floor(s / 3600), m = Math.floor(s / 60) % 60, r = s % 60;
  return `${h}:${String(m).padStart(2, "0")}:${String(r).padStart(2, "0")}`;
}

function push(arr, v) { arr.push(v); if (arr.length > HISTORY) arr.shift(); }

function sum(a) { return (a || []).reduce((x, y) => x + (y || 0), 0); }

function facts(dl, rows) {
  dl.replaceChildren(...rows.map(([k, v, cls]) => {
    const dd = el("dd", cls ? { class: cls } : {}, v);
    return dl.classList.contains("summary") ? el("div", {}, el("dt", {}, k), dd)
      : [el("dt", {}, k), dd];
  }).flat());
}

// -- canvas ------------------------------------------------------------------------------

function canvas2d(c) {
  // Size the backing store to the CSS box (and the screen's pixel ratio); coordinates in CSS px.
  const ratio = window.devicePixelRatio || 1;
  const w = c.clientWidth || 400, h = Number(c.getAttribute("height")) || 150;
  if (c.width !== Math.round(w * ratio) || c.height !== Math.round(h * ratio)) {
    c.width = Math.round(w * ratio); c.height = Math.round(h * ratio);
    c.style.height = h + "px";
  }
  const g = c.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, w, h);
  g.font = "11px system-ui, sans-serif";
  return { g, w, h };
}

function niceMax(v) {
  if (!(v > 0)) return 1;
  const p = 10 ** Math.floor(Math.log10(v)), m = v / p;
  return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * p;
}

// Lines over the sample history: series [{label, values, color}], shared y axis from 0.
function lineChart(c, series, unit) {
  const { g, w, h } = canvas2d(c);
  const L = 48, R = 8, T = 16, B = 14;
  let max = 0;
  for (const s of series) for (const v of s.values) if (v > max) max = v;
  max = niceMax(max);
  g.strokeStyle = GRID; g.fillStyle = MUTED; g.lineWidth = 1;
  for (let i = 0; i <= 2; i++) {
    const y = T + (h - T - B) * (1 - i / 2);
    g.beginPath(); g.moveTo(L, y); g.lineTo(w - R, y); g.stroke();
    g.fillText(fmtNum(max * i / 2) + (i === 2 && unit ? " " + unit : ""), 2, y + 4);
  }
  const n = HISTORY, dx = (w - L - R) / (n - 1);
  let lx = L;
  series.forEach((s, k) => {
    g.strokeStyle = s.color || COLORS[k % COLORS.length]; g.lineWidth = 1.5;
    if (s.dash) g.setLineDash([4, 3]); else g.setLineDash([]);
    g.beginPath();
    const off = n - s.values.length;
    let started = false;
    s.values.forEach((v, i) => {
      if (v === null || v === undefined) { started = false; return; }
      const x = L + (off + i) * dx, y = T + (h - T - B) * (1 - v / max);
      if (started) g.lineTo(x, y); else { g.moveTo(x, y); started = true; }
    });
    g.stroke();
    g.setLineDash([]);
    const last = s.values.length ? s.values[s.values.length - 1] : null;
    const text = `${s.label} ${fmtNum(last)}`;
    g.fillStyle = s.color || COLORS[k % COLORS.length];
    g.fillText(text, lx, 11);
    lx += g.measureText(text).width + 14;
  });
  g.fillStyle = MUTED;
  g.fillText("now", w - R - 20, h - 2);
}

// Rows of cells over time, colour by depth (log scale against the strip's max).
function heatStrip(c, rows) {
  const rowH = 14;
  c.setAttribute("height", String(Math.max(40, rows.length * rowH + 18)));
  const { g, w, h } = canvas2d(c);
  const L = 72, R = 8, T = 4;
  let max = 0;
  for (const r of rows) for (const v of r.values) if (v > max) max = v;
  const n = HISTORY, dx = (w - L - R) / n;
  rows.forEach((r, k) => {
    const y = T + k * rowH;
    g.fillStyle = MUTED;
    g.fillText(r.label, 2, y + rowH - 3);
    const off = n - r.values.length;
    r.values.forEach((v, i) => {
      if (!v) return;
      const f = max > 0 ? Math.log1p(v) / Math.log1p(max) : 0;
      g.fillStyle = `rgba(240, 136, 62, ${0.15 + 0.85 * f})`;
      g.fillRect(L + (off + i) * dx, y + 1, Math.max(1, dx), rowH - 2);
    });
  });
  g.fillStyle = MUTED;
  g.fillText(`max ${fmtNum(max)} in view`, L, h - 3);
}

// Bars per worker: groups [{label, values, color, max, fmt}].
function barChart(c, labels, groups) {
  const { g, w, h } = canvas2d(c);
  const L = 36, R = 8, T = 16, B = 16;
  const n = labels.length || 1, gw = (w - L - R) / n, bw = Math.max(2, gw * 0.8 / groups.length);
  let lx = L;
  groups.forEach((gr, j) => {
    g.fillStyle = gr.color;
    g.fillText(gr.label, lx, 11);
    lx += g.measureText(gr.label).width + 14;
    labels.forEach((_, i) => {
      const v = gr.values[i];
      if (v === null || v === undefined) return;
      const bh = (h - T - B) * Math.min(1, v / gr.max);
      const x = L + i * gw + gw * 0.1 + j * bw;
      g.fillStyle = gr.color;
      g.fillRect(x, h - B - bh, bw - 1, bh);
      g.fillStyle = "#e6edf3";
      g.fillText(gr.fmt(v), x, Math.max(T + 8, h - B - bh - 2));
    });
  });
  g.fillStyle = MUTED;
  labels.forEach((lab, i) => g.fillText(lab, L + i * gw + gw * 0.1, h - 3));
}

// A matrix of counts, rows = thieves, columns = victims (log colour; the diagonal greyed:
// a worker never steals from itself). More than `lump` rows or columns: the last is "rest".
function matrixGrid(c, m, lump) {
  const n = m.length, cols = n ? m[0].length : 0;
  const { g, w, h } = canvas2d(c);
  const L = 34, T = 14, size = Math.max(4, Math.min((w - L - 4) / Math.max(1, cols),
    (h - T - 4) / Math.max(1, n)));
  let max = 0;
  for (const r of m) for (const v of r) if (v > max) max = v;
  const name = (k, total) => (k === lump - 1 && total >= lump ? `w${k}+` : `w${k}`);
  g.fillStyle = MUTED;
  g.fillText("thief ↓ victim →", 0, 10);
  const step = Math.max(1, Math.ceil(12 / size)); // label every step-th row/column
  for (let j = 0; j < cols; j += step) g.fillText(name(j, cols), L + j * size + 1, T - 3 + 12);
  for (let i = 0; i < n; i++) {
    const y = T + 12 + i * size;
    if (i % step === 0) { g.fillStyle = MUTED; g.fillText(name(i, n), 2, y + Math.min(size, 12) - 2); }
    for (let j = 0; j < cols; j++) {
      const x = L + j * size, v = m[i][j];
      if (i === j && !(i === lump - 1 && n >= lump)) g.fillStyle = GRID;
      else if (!v) g.fillStyle = "#0f1419";
      else g.fillStyle = `rgba(63, 185, 80, ${0.2 + 0.8 * Math.log1p(v) / Math.log1p(max)})`;
      g.fillRect(x, y, size - 1, size - 1);
      if (v && size >= 26) {
        g.fillStyle = "#e6edf3";
        g.fillText(fmtNum(v), x + 3, y + size / 2 + 4);
      }
    }
  }
}

function matrixDiff(a, b) { // a - b, same shape (b may be missing or smaller: no history yet)
  return a.map((r, i) => r.map((v, j) => v - ((b && b[i] && b[i][j]) || 0)));
}

function drawMatrix(u) {
  const m = u.sm;
  $("p-matrix").hidden = !m || !m.length;
  if (!m || !m.length) return;
  const H = state.hist.sm, lump = (state.meta && state.meta.victims) || 64;
  const old = H.length > 40 ? H[H.length - 41] : H[0];
  const recent = matrixDiff(m, old);
  matrixGrid($("c-matrix-recent"), recent, lump);
  matrixGrid($("c-matrix-all"), m, lump);
  let best = null;
  recent.forEach((r, i) => r.forEach((v, j) => { if (v > 0 && (!best || v > best[0])) best = [v, i, j]; }));
  $("matrix-note").textContent = best
    ? `most in the last 10 s: w${best[1]} took ${fmtNum(best[0])} batches from w${best[2]}`
    : "no steals in the last 10 s";
}

// -- the latency CDF ------------------------------------------------------------------------

function bucketLo(i) {
  if (i < 128) return i;
  const e = (i >> 6) - 1;
  return (i - (e << 6)) * 2 ** e;
}

function bucketHi(i) {
  if (i < 128) return i + 1;
  const e = (i >> 6) - 1;
  return (i - (e << 6) + 1) * 2 ** e;
}

// [[x_ns, F(x)], ...] of one kind's sparse coarse histogram (g, c): F at each bucket's top.
function cdfPoints(k) {
  const group = (state.meta && state.meta.cdf_group) || 8;
  const total = sum(k.c);
  const pts = [];
  let acc = 0;
  k.g.forEach((gi, j) => {
    if (!pts.length) pts.push([Math.max(1, bucketLo(gi * group)), 0]);
    acc += k.c[j];
    pts.push([bucketHi(gi * group + group - 1), acc / total]);
  });
  return pts;
}

function fractionBelow(pts, x) {
  let f = 0;
  for (const [px, pf] of pts) { if (px <= x) f = pf; else break; }
  return f;
}

function drawCdf(c, kinds, slo) {
  const { g, w, h } = canvas2d(c);
  const L = 34, R = 10, T = 10, B = 28;
  const curves = [];
  let lo = Infinity, hi = 0;
  for (const [name, k, color] of kinds) {
    if (!k || !k.n) continue;
    const pts = cdfPoints(k);
    curves.push([name, k, color, pts]);
    lo = Math.min(lo, pts[0][0]); hi = Math.max(hi, pts[pts.length - 1][0], k.max || 0);
  }
  if (slo) { lo = Math.min(lo, slo); hi = Math.max(hi, slo); }
  if (!curves.length) {
    g.fillStyle = MUTED; g.fillText("no events in the window", L, h / 2);
    return;
  }
  const a = Math.floor(Math.log10(lo)), b = Math.max(a + 1, Math.ceil(Math.log10(hi)));
  const X = (ns) => L + (w - L - R) * (Math.log10(Math.max(ns, 1)) - a) / (b - a);
  const Y = (f) => T + (h - T - B) * (1 - f);
  g.strokeStyle = GRID; g.fillStyle = MUTED; g.lineWidth = 1;
  for (let d = a; d <= b; d++) {
    const x = X(10 ** d);
    g.beginPath(); g.moveTo(x, T); g.lineTo(x, h - B); g.stroke();
    g.fillText(fmtDecade(d), x - 10, h - B + 12);
  }
  for (const f of [0, 0.5, 1]) {
    g.beginPath(); g.moveTo(L, Y(f)); g.lineTo(w - R, Y(f)); g.stroke();
    g.fillText(f.toFixed(1), 4, Y(f) + 4);
  }
  const taken = []; // [x, row] of labels drawn: a label that would overlap goes a row down
  curves.forEach(([name, k, color, pts], j) => {
    g.strokeStyle = color; g.lineWidth = 1.5;
    g.beginPath();
    pts.forEach(([x, f], i) => { if (i) g.lineTo(X(x), Y(f)); else g.moveTo(X(x), Y(f)); });
    g.stroke();
    // markers: a dashed line per percentile, labelled near the top
    for (const [m, label] of [["p50", "50"], ["p99", "99"], ["p999", "99.9"], ["max", "max"]]) {
      if (k[m] === undefined) continue;
      const x = X(k[m]);
      g.strokeStyle = color; g.setLineDash([2, 2]);
      g.beginPath(); g.moveTo(x, T); g.lineTo(x, h - B); g.stroke(); g.setLineDash([]);
      const width = g.measureText(label).width + 4;
      let row = 0;
      while (taken.some(([tx, tw, tr]) => tr === row && x < tx + tw && tx < x + width)) row++;
      taken.push([x, width, row]);
      g.fillStyle = color;
      g.fillText(label, x + 2, T + 10 + row * 11);
    }
    g.fillText(name, L + 6, T + 10 + (j + 3) * 11);
  });
  if (slo) {
    g.strokeStyle = "#f85149"; g.lineWidth = 2;
    g.beginPath(); g.moveTo(X(slo), T); g.lineTo(X(slo), h - B); g.stroke();
    g.fillStyle = "#f85149"; g.fillText("SLO", X(slo) + 3, h - B - 4);
  }
}

// -- panels -------------------------------------------------------------------------------

function updateHeader(u) {
  $("exec-id").textContent = u.id;
  const tot = u.tot || {};
  const rows = [["up", fmtUptime(u.up_s)], ["workers", String(u.w.pid.length)],
    ["running", String(sum(u.w.run))], ["steps", fmtNum(tot.tasks)],
    ["steps/s", fmtNum(u.rate.tasks)], ["injector", fmtNum(u.inj)]];
  if (u.client) rows.push(["pending", fmtNum(u.client.pending)], ["backlog", fmtNum(u.client.backlog)]);
  rows.push(["records free", `${fmtNum(u.rec[0])} / ${fmtNum(u.rec[1])}`]);
  facts($("summary"), rows);
}

function updateHistory(u) {
  const H = state.hist;
  push(H.t, u.t);
  push(H.rate, u.rate.tasks);
  push(H.agentRate, u.rate.agent_steps);
  const dq = sum(u.w.deque), ib = sum(u.w.inbox);
  push(H.queued, dq + ib);
  push(H.injector, u.inj);
  push(H.pending, u.client ? u.client.pending : null);
  push(H.steals, u.rate.steals);
  push(H.attempts, u.rate.steal_attempts);
  push(H.migr, u.rate.migrations);
  push(H.jlag, u.jr ? u.jr.lag_ms : null);
  const n = u.w.deque.length;
  while (H.deque.length < n) { H.deque.push([]); H.inbox.push([]); }
  for (let k = 0; k < n; k++) { push(H.deque[k], u.w.deque[k]); push(H.inbox[k], u.w.inbox[k]); }
  if (u.sm) { H.sm.push(u.sm); if (H.sm.length > 41) H.sm.shift(); } // 10 s of matrices
}

function drawTimeCharts(u) {
  const H = state.hist;
  const rate = [{ label: "steps/s", values: H.rate, color: COLORS[0] }];
  if (u.ag.live || H.agentRate.some((v) => v)) {
    rate.push({ label: "agent steps/s", values: H.agentRate, color: COLORS[3] });
  }
  lineChart($("c-rate"), rate, "/s");
  const queued = [{ label: "deques+inboxes", values: H.queued, color: COLORS[2] },
    { label: "injector", values: H.injector, color: COLORS[5] }];
  if (u.client) queued.unshift({ label: "pending", values: H.pending, color: COLORS[1] });
  lineChart($("c-queued"), queued, "");
  lineChart($("c-steals"), [
    { label: "attempted/s", values: H.attempts, color: COLORS[2], dash: true },
    { label: "successful/s", values: H.steals, color: COLORS[1] }], "/s");
  const att = sum(H.attempts.slice(-40)), ok = sum(H.steals.slice(-40));
  $("steal-ratio").textContent = att
    ? `last 10 s: ${(100 * ok / att).toFixed(1)}% of steal attempts took work; ` +
      `${fmtNum(u.tot.steals)} steals, ${fmtNum(u.tot.steal_attempts)} attempts since start`
    : `no steal attempts in the last 10 s (${fmtNum(u.tot.steals)} steals since start)`;
  const rows = [];
  H.deque.forEach((d, k) => {
    rows.push({ label: `w${k} deque`, values: d });
    rows.push({ label: `w${k} inbox`, values: H.inbox[k] });
  });
  heatStrip($("c-heat"), rows);
}

function updateLatency(u) {
  const box = $("latency");
  const tiers = (state.meta ? state.meta.tiers : Object.keys(u.lat)).filter((t) => u.lat[t]);
  $("lat-window").textContent = `last ${fmtNum(u.win_s)} s`;
  const seen = new Set();
  for (const tier of tiers) {
    seen.add(tier);
    let div = box.querySelector(`[data-tier="${tier}"]`);
    if (!div) {
      div = el("div", { class: "tier", "data-tier": tier }, el("h3", {}, tier),
        el("canvas", { height: "190" }), el("p", { class: "note" }));
      box.append(div);
    }
    const t = u.lat[tier];
    drawCdf(div.querySelector("canvas"), [["wait", t.wait, COLORS[2]], ["run", t.run, COLORS[0]]],
      state.slo);
    const parts = [];
    for (const kind of ["wait", "run"]) {
      const k = t[kind];
      if (!k) continue;
      parts.push(`${kind}: ${fmtNum(k.n)} in window, p50 ${fmtNs(k.p50)}, p99 ${fmtNs(k.p99)}, ` +
        `p99.9 ${fmtNs(k.p999)}, max ${fmtNs(k.max)}` +
        (state.slo && k.n ? `, ${(100 * fractionBelow(cdfPoints(k), state.slo)).toFixed(2)}% ≤ SLO`
          : "") +
        ` · since start p99 ${fmtNs(k.all.p99)} of ${fmtNum(k.all.n)}`);
    }
    div.querySelector("p").textContent = parts.join(" | ");
  }
  for (const div of [...box.children]) if (!seen.has(div.dataset.tier)) div.remove();
  $("p-latency").hidden = !tiers.length;
}

const WORKER_COLS = [
  ["#", (u, k) => k], ["pid", (u, k) => u.w.pid[k] ?? "–"], ["cpu", (u, k) => u.w.cpu[k] ?? "–"],
  ["state", (u, k) => (u.w.frozen_s[k] > 1 ? `frozen ${Math.round(u.w.frozen_s[k])}s`
    : u.w.state[k]), "left"],
  ["run", (u, k) => (u.w.run[k] ? "●" : "")],
  ["busy %", (u, k) => (u.w.busy[k] === null ? "–" : (100 * u.w.busy[k]).toFixed(1))],
  ["cpu %", (u, k) => fmtNum(u.w.proc_cpu ? u.w.proc_cpu[k] : null)],
  ["rss", (u, k) => fmtBytes(u.w.rss ? u.w.rss[k] : null)],
  ["deque", (u, k) => u.w.deque[k]], ["inbox", (u, k) => u.w.inbox[k]],
  ["steps/s", (u, k) => fmtNum(u.w.tasks_s[k])], ["steals/s", (u, k) => fmtNum(u.w.steals_s[k])],
  ["attempts/s", (u, k) => fmtNum(u.w.attempts_s[k])], ["parks/s", (u, k) => fmtNum(u.w.parks_s[k])],
  ["agent steps/s", (u, k) => fmtNum(u.w.agent_steps_s[k])],
  ["migrations/s", (u, k) => fmtNum(u.w.migr_s[k])],
];

function updateWorkers(u) {
  const t = $("t-workers");
  if (!t.tHead.rows.length) {
    t.tHead.append(el("tr", {}, ...WORKER_COLS.map(([h, , cls]) => el("th", cls ? { class: cls } : {}, h))));
  }
  const rows = u.w.pid.map((_, k) => el("tr", u.w.frozen_s[k] > 1 ? { class: "frozen" } : {},
    ...WORKER_COLS.map(([, f, cls]) => el("td", cls ? { class: cls } : {}, f(u, k)))));
  t.tBodies[0].replaceChildren(...rows);
  const labels = u.w.pid.map((_, k) => `w${k}`);
  const hasProc = u.w.proc_cpu && u.w.proc_cpu.some((v) => v !== null);
  $("p-cpu").hidden = !hasProc;
  if (hasProc) {
    const top = Math.max(100, ...u.w.proc_cpu.filter((v) => v !== null));
    barChart($("c-cpu"), labels, [
      { label: "process CPU %", values: u.w.proc_cpu, color: COLORS[0], max: top,
        fmt: (v) => v.toFixed(0) },
      { label: "in task code % (wall time)", values: u.w.busy.map((b) => (b === null ? null : 100 * b)),
        color: COLORS[1], max: top, fmt: (v) => v.toFixed(0) }]);
    const rmax = Math.max(1, ...u.w.rss.filter((v) => v !== null));
    barChart($("c-rss"), labels, [{ label: "RSS", values: u.w.rss, color: COLORS[3],
      max: rmax * 1.15, fmt: fmtBytes }]);
  }
}

function updatePinning(u) {
  const box = $("pinning");
  const topo = state.meta && state.meta.topology;
  const at = new Map();
  u.w.cpu.forEach((c, k) => { if (c !== null) at.set(c, [...(at.get(c) || []), k]); });
  const unpinned = u.w.cpu.map((c, k) => (c === null ? `w${k}` : null)).filter(Boolean);
  const parts = [];
  if (topo) {
    const pkgs = new Map();
    for (const c of topo.cpus) {
      const key = `package ${c.package}, node ${c.node}`;
      if (!pkgs.has(key)) pkgs.set(key, new Map());
      const cores = pkgs.get(key);
      if (!cores.has(c.core)) cores.set(c.core, []);
      cores.get(c.core).push(c.id);
    }
    const wrap = el("div", { class: "topo" });
    for (const [key, cores] of pkgs) {
      const row = el("div", { class: "cores" });
      for (const ids of cores.values()) {
        row.append(el("div", { class: "core" }, ...ids.map((id) => {
          const ws = at.get(id) || [];
          const busy = ws.some((k) => u.w.run[k]);
          return el("div", { class: `cpu${ws.length ? " used" : ""}${busy ? " busy" : ""}` },
            el("b", {}, `cpu ${id}`), ws.length ? ws.map((k) => `w${k}`).join(" ") : "·");
        })));
      }
      wrap.append(el("div", { class: "pkg" }, el("span", {}, key), row));
    }
    parts.push(wrap);
    if (topo.quota_cpus) parts.push(el("p", { class: "note" }, `cgroup quota: ${topo.quota_cpus} CPUs`));
  } else {
    parts.push(el("p", {}, u.w.cpu.map((c, k) => `w${k} → ${c === null ? "any" : "cpu " + c}`).join(", ")));
  }
  if (unpinned.length) parts.push(el("p", { class: "note" }, `not pinned: ${unpinned.join(" ")}`));
  box.replaceChildren(...parts);
}

function updateFaults(u) {
  const rows = [["task errors", fmtNum(u.tot.errors), u.tot.errors ? "bad" : ""]];
  const frozen = u.w.frozen_s.filter((s) => s > 1).length;
  rows.push(["workers frozen now", String(frozen), frozen ? "bad" : ""]);
  if (u.client) {
    rows.push(["worker crashes", fmtNum(u.client.crashes), u.client.crashes ? "bad" : ""],
      ["replacements started", fmtNum(u.client.replacements)],
      ["ring cells repaired", fmtNum(u.client.rings_repaired)],
      ["stray completions", fmtNum(u.client.stray_completions)]);
  }
  facts($("faults"), rows);
}

const AGENT_COLS = [["id", "id", "left"], ["worker", "worker"], ["gen", "gen"],
  ["mailbox", "mailbox"], ["oldest msg ms", "oldest_ms"], ["steps", "steps"], ["steps/s", "steps_s"], ["messages", "msgs"],
  ["CPU ms", "cpu_ms"], ["CPU %", "cpu_pct"], ["migrations", "migr"]];

function updateAgents(u) {
  const a = u.ag;
  $("p-agents").hidden = !a.live && !a.rows.length;
  if ($("p-agents").hidden) return;
  facts($("agents-summary"), [["live", fmtNum(a.live)], ["steps/s", fmtNum(u.rate.agent_steps)],
    ["messages/s", fmtNum(u.rate.agent_messages)], ["migrations/s", fmtNum(u.rate.migrations)],
    ["throttled/s", fmtNum(u.rate.throttled)], ["migrations", fmtNum(u.tot.migrations)]]);
  lineChart($("c-migr"), [{ label: "migrations/s (agents moved to an idle peer)",
    values: state.hist.migr, color: COLORS[4] }], "/s");
  const t = $("t-agents");
  t.tHead.replaceChildren(el("tr", {}, ...AGENT_COLS.map(([h, key, cls]) => {
    const th = el("th", { class: `sortable${cls ? " " + cls : ""}${state.sort.key === key ? " sorted" : ""}` },
      h + (state.sort.key === key ? (state.sort.dir < 0 ? " ▼" : " ▲") : ""));
    th.addEventListener("click", () => {
      state.sort = { key, dir: state.sort.key === key ? -state.sort.dir : -1 };
      updateAgents(state.last);
    });
    return th;
  })));
  const { key, dir } = state.sort;
  const rows = [...a.rows].sort((x, y) => {
    const p = x[key] ?? -1, q = y[key] ?? -1;
    return (p < q ? -1 : p > q ? 1 : 0) * dir;
  });
  t.tBodies[0].replaceChildren(...rows.map((r) => el("tr", { "data-agent": r.id },
    ...AGENT_COLS.map(([, k, cls]) => el("td", cls ? { class: cls } : {},
      k === "cpu_ms" || k === "cpu_pct" || k === "steps_s" || k === "oldest_ms" ? fmtNum(r[k]) : (r[k] ?? "–"))))));
}

function updateMaps(u) {
  const maps = u.maps || [];
  $("p-maps").hidden = !u.client; // only the executor's own process knows its maps
  if (!u.client) return;
  const rows = maps.map((m) => {
    const frac = m.total ? Math.min(1, m.done / m.total) : null;
    const rate = m.elapsed_s > 0 ? m.done / m.elapsed_s : 0;
    const eta = m.total && rate > 0 ? ` · eta ${fmtNum((m.total - m.done) / rate, 1)} s` : "";
    const fill = el("div", {});
    fill.style.width = `${frac === null ? 100 : 100 * frac}%`; // CSSOM: no inline style under the CSP
    return el("div", { class: "map", "data-label": m.label }, el("div", { class: "bar" }, fill),
      el("p", {}, `${m.label} ${fmtNum(m.done)} / ${m.total === null ? "?" : fmtNum(m.total)}` +
        (frac === null ? "" : ` (${(100 * frac).toFixed(1)}%)`) +
        ` · ${fmtNum(rate)}/s · ${fmtNum(m.elapsed_s, 1)} s${eta}`));
  });
  if (u.maps_more) rows.push(el("p", { class: "note" }, `and ${u.maps_more} more`));
  if (!rows.length) rows.push(el("p", { class: "note" }, "none running"));
  $("maps").replaceChildren(...rows);
}

function updateJournal(u) {
  const j = u.jr;
  $("c-journal").hidden = !j || j.lag_ms === null;
  if (!j) {
    facts($("journal"), [["journal", "off"], ["", "no Executor(journal=PATH): agents are not durable"]]);
    return;
  }
  const rows = [["durability", j.mode], ["events committed", fmtNum(j.events)]];
  if (j.lag_ms === null) {
    rows.push(["lag", "not tracked: the OS writes back when it likes"]);
  } else {
    rows.push(["not yet fsync'ed", `${fmtNum(j.unsynced)} events`],
      ["lag (oldest of them)", `${fmtNum(j.lag_ms, 1)} ms`, j.lag_ms > 1000 ? "bad" : ""]);
    const worst = [...j.shards].sort((a, b) => b.lag_ms - a.lag_ms)[0];
    if (worst && worst.lag_ms > 0) rows.push(["worst shard", `${worst.shard}: ${fmtNum(worst.unsynced)} events, ${fmtNum(worst.lag_ms, 1)} ms`]);
    lineChart($("c-journal"), [{ label: "lag ms", values: state.hist.jlag, color: COLORS[6] }], "ms");
  }
  facts($("journal"), rows);
}

function updateFooter(u) {
  const s = u.smp || {};
  $("footer").textContent = `update ${fmtNum(s.bytes)} bytes every ${s.interval_s} s · sampler ` +
    `${fmtNum(s.cpu_ms_s, 2)} ms CPU per s for ${s.pages} page(s) · read-only · ` +
    `stealer ${state.meta ? state.meta.version : ""}`;
}

function draw(u) {
  updateHeader(u);
  drawTimeCharts(u);
  drawMatrix(u);
  updateLatency(u);
  updateWorkers(u);
  updatePinning(u);
  updateFaults(u);
  updateJournal(u);
  updateMaps(u);
  updateAgents(u);
  updateFooter(u);
}

function render(u) {
  if (u.cluster) { renderCluster(u); return; }
  updateHistory(u);
  draw(u);
}

// A cluster executor: one row per node, the figures `stealer top` draws (no per-worker
// panels: the workers run on the nodes).
const NODE_COLS = [
  ["node", (n) => n.id.slice(0, 12), "mono"], ["alive", (n) => (n.alive ? "yes" : "lost")],
  ["wrk", (n) => fmtNum(n.workers), "num"], ["busy %", (n) => fmtNum(n.busy), "num"],
  ["queued", (n) => fmtNum(n.queued), "num"], ["run", (n) => fmtNum(n.running), "num"],
  ["done", (n) => fmtNum(n.done), "num"], ["tasks/s", (n) => fmtNum(n.tasks_s), "num"],
  ["msgs/s", (n) => fmtNum(n.msgs_s), "num"], ["agents", (n) => fmtNum(n.agents), "num"],
  ["active", (n) => fmtNum(n.active), "num"], ["got", (n) => fmtNum(n.got), "num"],
  ["given", (n) => fmtNum(n.given), "num"], ["children out", (n) => fmtNum(n.children_out), "num"],
  ["children in", (n) => fmtNum(n.children_in), "num"],
  ["p50 ms", (n) => fmtNum(n.p50_ms, 2), "num"], ["p99 ms", (n) => fmtNum(n.p99_ms, 2), "num"]];

function renderCluster(u) {
  const c = u.cluster;
  for (const s of document.querySelectorAll("main > section")) s.hidden = s.id !== "p-nodes";
  $("exec-id").textContent = c.id;
  const alive = c.nodes.filter((n) => n.alive).length;
  facts($("summary"), [["up", fmtUptime(c.uptime_s)], ["nodes", `${alive} of ${c.nodes.length}`],
    ["submitted", fmtNum(c.submitted)], ["outstanding", fmtNum(c.outstanding)],
    ["stolen", fmtNum(c.moved)], ["re-placed", fmtNum(c.resubmitted)],
    ["agent moves", fmtNum(c.agent_moves)]]);
  const t = $("t-nodes");
  if (!t.tHead.rows.length) {
    t.tHead.append(el("tr", {}, ...NODE_COLS.map(([h, , cls]) => el("th", cls ? { class: cls } : {}, h))));
  }
  t.tBodies[0].replaceChildren(...c.nodes.map((n) => el("tr", n.alive ? {} : { class: "frozen" },
    ...NODE_COLS.map(([, f, cls]) => el("td", cls ? { class: cls } : {}, f(n))))));
  $("nodes-note").textContent = `${fmtNum(c.duplicates)} duplicate results dropped · ` +
    `${fmtNum(c.replayed)} agent messages replayed · ${c.losses} node(s) lost · ` +
    `moves ${fmtNum(c.move_ms)} ms each`;
  updateFooter(u);
}

function setStatus(text, cls) {
  const s = $("status");
  s.textContent = text;
  s.className = `status ${cls}`;
}

// -- start --------------------------------------------------------------------------------

function connect() {
  const es = new EventSource("events");
  es.onopen = () => setStatus("live", "live");
  es.onmessage = (ev) => {
    const u = JSON.parse(ev.data);
    if (u.gone) {
      setStatus(`executor gone: ${u.gone}`, "gone");
      es.close();
      return;
    }
    if (u.error) { setStatus(`read failed: ${u.error}`, "error"); return; }
    state.last = u;
    state.updates += 1;
    render(u);
    // page ready: navigation start (performance's time origin) -> the first update drawn
    if (state.readyMs === null) state.readyMs = performance.now();
  };
  es.onerror = () => { if (es.readyState !== EventSource.CLOSED) setStatus("reconnecting…", "error"); };
}

function start() {
  if (location.search.includes("token=")) {
    history.replaceState(null, "", location.pathname); // the cookie has it now
  }
  $("slo").addEventListener("input", (ev) => {
    const v = parseFloat(ev.target.value);
    state.slo = v > 0 ? v * 1e6 : null;
    if (state.last) updateLatency(state.last);
  });
  window.addEventListener("resize", () => { if (state.last) draw(state.last); });
  fetch("api/meta", { credentials: "same-origin" })
    .then((r) => (r.ok ? r.json() : Promise.reject(new Error(`meta: HTTP ${r.status}`))))
    .then((m) => { state.meta = m; document.title = `stealer · ${m.id}`; connect(); })
    .catch((e) => setStatus(String(e), "error"));
}

document.addEventListener("DOMContentLoaded", start);
