// hybridrl dashboard: polls the server's JSON endpoints and draws with plotly.js (served locally).
"use strict";

const POLL_MS = Number(document.body.dataset.pollMs) || 2000;
// the URL's ?token= set the server's cookie, which the page's requests carry: drop it from the address bar
if (new URLSearchParams(location.search).has("token")) history.replaceState(null, "", location.pathname);
const state = {
  metrics: [], metricsVersion: null, metricsNext: 0, lastStep: 0, lastRowTime: null,
  dist: new Map(), distVersion: null, lastDistStep: 0,
  sampleStep: null, sampleRows: [], sampleSort: null,
  totalSteps: null, polls: 0,
};
window.hybridrlDashboard = state; // for debugging and tests

const $ = (id) => document.getElementById(id);
const LAYOUT = {
  margin: { l: 50, r: 50, t: 28, b: 40 },
  xaxis: { title: { text: "step", standoff: 4 }, zeroline: false },
  legend: { orientation: "h", x: 0, y: 1.0, yanchor: "bottom" },
  hovermode: "x unified",
  paper_bgcolor: "#fff", plot_bgcolor: "#fff",
};
const CONFIG = { displaylogo: false, responsive: true };

async function getJSON(url) {
  const r = await fetch(url, { cache: "no-store" });
  if (!r.ok) throw new Error(`${url}: HTTP ${r.status}`);
  return r.json();
}

function layout(extra) {
  // steps are integers: a tick every dtick steps, never between two steps
  const n = state.metrics.length ? state.metrics[state.metrics.length - 1].step - state.metrics[0].step : 0;
  const dtick = Math.max(1, Math.ceil(n / 10));
  return { ...LAYOUT, ...extra, xaxis: { ...LAYOUT.xaxis, tick0: 0, dtick } };
}

// the training steps' rows: an evaluation before training (step 0) has a row of eval/* alone
function isEval(key) { return key.startsWith("eval/") || key === "timing/eval"; }
function trained() {
  return state.metrics.filter((row) => Object.keys(row).some((k) => k !== "step" && k !== "time" && !isEval(k)));
}
function series(key) {
  return trained().map((row) => (row[key] === undefined ? null : row[key]));
}
function steps() { return trained().map((row) => row.step); }
function points(key) {
  // the steps that have the metric (an evaluation's metrics are at some steps only), and its values
  const rows = state.metrics.filter((row) => row[key] !== undefined && row[key] !== null);
  return { x: rows.map((row) => row.step), y: rows.map((row) => row[key]) };
}
// an evaluation set's metrics (docs/evaluation.md): eval/<set>/<metric>, eval/<set>/<source>/<metric>
const EVAL_KEY = /^eval\/(.+)\/(score|mean@\d+|pass@\d+)$/;
function has(key) { return state.metrics.some((row) => row[key] !== undefined && row[key] !== null); }
function allKeys() {
  const keys = new Set();
  for (const row of state.metrics) for (const k of Object.keys(row)) if (k !== "step" && k !== "time") keys.add(k);
  return [...keys].sort();
}

function band(x, lo, hi, name, color) {
  // a filled band between two series: the upper edge, then the lower edge filled up to it
  return [
    { x, y: hi, mode: "lines", line: { width: 0 }, hoverinfo: "skip", showlegend: false, name: name + " hi" },
    { x, y: lo, mode: "lines", line: { width: 0 }, fill: "tonexty", fillcolor: color, name, hoverinfo: "skip" },
  ];
}

function drawReward() {
  const x = steps();
  const mean = series("reward/mean"), std = series("reward/std");
  const traces = [];
  if (has("reward/min") && has("reward/max")) traces.push(...band(x, series("reward/min"), series("reward/max"), "min–max", "rgba(9,105,218,0.10)"));
  if (has("reward/std")) {
    traces.push(...band(x, mean.map((m, i) => (m === null || std[i] === null ? null : m - std[i])),
      mean.map((m, i) => (m === null || std[i] === null ? null : m + std[i])), "± std", "rgba(9,105,218,0.22)"));
  }
  traces.push({ x, y: mean, mode: "lines+markers", name: "mean", line: { color: "#0969da", width: 2 } });
  for (const key of allKeys()) {
    const m = key.match(/^reward\/(.+)\/mean$/);
    if (m) traces.push({ x, y: series(key), mode: "lines", name: m[1], line: { dash: "dot", width: 1.5 } });
  }
  for (const key of allKeys()) {  // each held-out set's score, measured where it was evaluated
    const m = key.match(EVAL_KEY);
    if (m && m[2] === "score" && !m[1].includes("/")) {
      traces.push({ ...points(key), mode: "lines+markers", name: `eval ${m[1]}`, line: { dash: "dash", width: 1.5 } });
    }
  }
  Plotly.react("chart-reward", traces, layout({ yaxis: { title: { text: "reward" } } }), CONFIG);
}

function drawEval() {
  const traces = [];
  for (const key of allKeys()) {
    const m = key.match(EVAL_KEY);
    if (m && m[2] !== "score") traces.push({ ...points(key), mode: "lines+markers", name: `${m[1]} ${m[2]}` });
  }
  $("no-eval").hidden = traces.length > 0;
  Plotly.react("chart-eval", traces, layout({ yaxis: { title: { text: "fraction correct" }, range: [0, 1.02] } }), CONFIG);
}

function drawKL() {
  const x = steps();
  const traces = [{ x, y: series("actor/kl"), mode: "lines+markers", name: "actor/kl", line: { color: "#8250df" } }];
  if (has("actor/entropy")) {
    traces.push({ x, y: series("actor/entropy"), mode: "lines", name: "entropy (right)", yaxis: "y2", line: { color: "#bf8700", dash: "dot" } });
  }
  Plotly.react("chart-kl", traces, layout({
    yaxis: { title: { text: "KL" }, rangemode: "tozero" },
    yaxis2: { title: { text: "entropy" }, overlaying: "y", side: "right", showgrid: false },
  }), CONFIG);
}

function drawLength() {
  const x = steps();
  const traces = [];
  if (has("response_length/min") && has("response_length/max")) {
    traces.push(...band(x, series("response_length/min"), series("response_length/max"), "min–max", "rgba(26,127,55,0.12)"));
  }
  traces.push({ x, y: series("response_length/mean"), mode: "lines+markers", name: "mean", line: { color: "#1a7f37" } });
  if (has("response_length/clip_ratio")) {
    traces.push({ x, y: series("response_length/clip_ratio"), mode: "lines", name: "clip ratio (right)", yaxis: "y2", line: { color: "#cf222e", dash: "dot" } });
  }
  Plotly.react("chart-length", traces, layout({
    yaxis: { title: { text: "tokens" }, rangemode: "tozero" },
    yaxis2: { title: { text: "clipped" }, overlaying: "y", side: "right", range: [0, 1], showgrid: false },
  }), CONFIG);
}

function drawDist() {
  const field = $("dist-field").value || "score";
  const x = [], y = [];
  for (const [step, entry] of [...state.dist.entries()].sort((a, b) => a[0] - b[0])) {
    for (const v of entry.values[field] || []) if (v !== null) { x.push(step); y.push(v); }
  }
  Plotly.react("chart-dist", [{
    type: "box", x, y, name: field, boxpoints: "all", jitter: 0.5, pointpos: 0,
    marker: { size: 4, color: "#0969da", opacity: 0.6 }, line: { color: "#0550ae" }, fillcolor: "rgba(9,105,218,0.12)",
  }], layout({ hovermode: "closest", showlegend: false, yaxis: { title: { text: field } } }), CONFIG);
}

function drawMetric() {
  const key = $("metric-pick").value;
  Plotly.react("chart-metric", key ? [{ ...points(key), mode: "lines+markers", name: key }] : [],
    layout({ showlegend: false, yaxis: { title: { text: key || "" } } }), CONFIG);
}

function fillSelect(select, values, preferred) {
  const current = select.value;
  const existing = [...select.options].map((o) => o.value);
  if (existing.length === values.length && existing.every((v, i) => v === String(values[i]))) return false;
  select.replaceChildren(...values.map((v) => new Option(String(v), String(v))));
  if (values.map(String).includes(current)) select.value = current;
  else if (preferred !== undefined && values.map(String).includes(String(preferred))) select.value = String(preferred);
  return true;
}

// --- samples ----------------------------------------------------------------------------------

const FIRST_COLUMNS = ["index", "prompt", "response", "score"];
const HIDDEN_COLUMNS = new Set(["step"]);

function columnsOf(rows) {
  const cols = [...FIRST_COLUMNS.filter((c) => rows.some((r) => c in r))];
  for (const r of rows) for (const k of Object.keys(r)) if (!cols.includes(k) && !HIDDEN_COLUMNS.has(k)) cols.push(k);
  return cols;
}

function fmt(v) {
  if (v === null || v === undefined) return "";
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : v.toFixed(4);
  if (typeof v === "object") return JSON.stringify(v);
  return String(v);
}

function drawSamples() {
  const rows = state.sampleRows;
  const filter = $("sample-filter").value.toLowerCase();
  const shown = rows.filter((r) => !filter || JSON.stringify(r).toLowerCase().includes(filter));
  if (state.sampleSort) {
    const { key, dir } = state.sampleSort;
    shown.sort((a, b) => ((a[key] ?? -Infinity) > (b[key] ?? -Infinity) ? dir : -dir));
  }
  const cols = columnsOf(rows);
  const head = document.createElement("tr");
  for (const c of cols) {
    const th = document.createElement("th");
    th.textContent = c + (state.sampleSort && state.sampleSort.key === c ? (state.sampleSort.dir > 0 ? " ▲" : " ▼") : "");
    th.onclick = () => {
      const dir = state.sampleSort && state.sampleSort.key === c ? -state.sampleSort.dir : -1;
      state.sampleSort = { key: c, dir };
      drawSamples();
    };
    head.appendChild(th);
  }
  $("samples").tHead.replaceChildren(head);
  let lastPrompt = null;
  const body = shown.map((r) => {
    const tr = document.createElement("tr");
    const grouped = !state.sampleSort && !filter;
    const sameGroup = grouped && r.prompt === lastPrompt;
    if (grouped && !sameGroup) tr.className = "group-start";
    lastPrompt = r.prompt;
    for (const c of cols) {
      const td = document.createElement("td");
      const v = r[c];
      td.textContent = c === "prompt" && sameGroup ? "(same prompt)" : fmt(v);
      if (typeof v === "number") {
        td.className = "num" + (c === "advantage" ? (v > 0 ? " pos" : v < 0 ? " neg" : "") : "");
      } else if (c === "prompt" || c === "response") {
        td.className = "text " + c;
      }
      tr.appendChild(td);
    }
    return tr;
  });
  $("samples").tBodies[0].replaceChildren(...body);
  $("sample-count").textContent = rows.length ? `${shown.length} of ${rows.length} responses` : "";
  $("no-samples").hidden = rows.length > 0;
}

async function loadSamples(step) {
  if (step === null) return;
  const data = await getJSON(`/api/samples?step=${step}`);
  state.sampleStep = step;
  state.sampleRows = data.rows;
  drawSamples();
}

// --- polling ----------------------------------------------------------------------------------

async function pollMetrics() {
  const v = state.metricsVersion === null ? "" : state.metricsVersion;
  const data = await getJSON(`/api/metrics?version=${v}&from=${state.metricsNext}`);
  if (data.reset) state.metrics = [];
  state.metricsVersion = data.version;
  state.metricsNext = data.next;
  if (!data.rows.length && !data.reset) return false;
  // a step's rows merged: an evaluation's row follows the row of the step it was measured after
  const byStep = new Map(state.metrics.map((r) => [r.step, r]));
  for (const row of data.rows) byStep.set(row.step, { ...(byStep.get(row.step) || {}), ...row });
  state.metrics = [...byStep.values()].sort((a, b) => a.step - b.step);
  const last = state.metrics[state.metrics.length - 1];
  state.lastStep = last ? last.step : 0;
  state.lastRowTime = last && last.time ? last.time : null;
  return true;
}

async function pollDistribution() {
  const v = state.distVersion === null ? "" : state.distVersion;
  const data = await getJSON(`/api/distribution?version=${v}&after=${state.lastDistStep}`);
  if (data.reset) state.dist = new Map();
  state.distVersion = data.version;
  for (const entry of data.steps) state.dist.set(entry.step, entry);
  state.lastDistStep = Math.max(0, ...state.dist.keys());
  return data.reset || data.steps.length > 0;
}

function updateStatus() {
  const el = $("status");
  const total = state.totalSteps ? `/${state.totalSteps}` : "";
  if (!state.metrics.length) { el.textContent = "waiting for metrics.jsonl…"; el.className = ""; return; }
  const ago = state.lastRowTime ? Math.max(0, Date.now() / 1000 - state.lastRowTime) : null;
  const last = state.metrics[state.metrics.length - 1];
  const parts = [`step ${state.lastStep}${total}`];
  if (last["reward/mean"] != null) parts.push(`reward ${last["reward/mean"].toFixed(3)}`);
  if (ago !== null) parts.push(`last step ${ago < 90 ? Math.round(ago) + " s" : Math.round(ago / 60) + " min"} ago`);
  el.textContent = parts.join(" · ");
  el.className = ago !== null && ago < 300 ? "live" : "stale";
}

async function tick() {
  try {
    const newMetrics = await pollMetrics();
    const newDist = await pollDistribution();
    if (newMetrics) {
      drawReward(); drawEval(); drawKL(); drawLength();
      fillSelect($("metric-pick"), allKeys(), "timing/step");
      drawMetric();
    }
    if (newDist) {
      const fields = new Set();
      for (const e of state.dist.values()) for (const k of Object.keys(e.values)) fields.add(k);
      const ordered = ["score", ...[...fields].filter((f) => f !== "score").sort()].filter((f) => fields.has(f));
      fillSelect($("dist-field"), ordered, "score");
      drawDist();
      const sampleSteps = [...state.dist.keys()].sort((a, b) => b - a);
      fillSelect($("sample-step"), sampleSteps);
      const latest = sampleSteps[0];
      if ($("follow").checked && latest !== undefined && latest !== state.sampleStep) {
        $("sample-step").value = String(latest);
        await loadSamples(latest);
      } else if (state.sampleStep === null && latest !== undefined) {
        await loadSamples(latest);
      }
    }
    state.polls += 1;
    updateStatus();
  } catch (err) {
    $("status").textContent = `cannot reach the dashboard server (${err.message}); retrying…`;
    $("status").className = "stale";
  }
  setTimeout(tick, POLL_MS);
}

async function init() {
  try {
    const info = await getJSON("/api/run");
    $("run-name").textContent = info.name;
    document.title = `${info.name} · hybridrl`;
    $("config").textContent = info.config || "(no config.yaml)";
    state.totalSteps = info.total_steps || null;
  } catch (err) { /* the first tick reports it */ }
  $("metric-pick").onchange = drawMetric;
  $("dist-field").onchange = drawDist;
  $("sample-filter").oninput = drawSamples;
  $("sample-step").onchange = () => {
    $("follow").checked = false;
    loadSamples(Number($("sample-step").value));
  };
  tick();
}

init();
