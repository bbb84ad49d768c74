// The study's charts and the best-per-model-size chart (plotly.js, served locally). Each chart
// sets data-points on its container after plotly has drawn it: the number of marks of its main
// trace, so tests can compare what was drawn with the database.

import { loadPlotly, plotText } from "./lib.js";

const CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["select2d", "lasso2d"] };
const BASE = {
  margin: { l: 64, r: 16, t: 36, b: 48 },
  font: { family: "system-ui, sans-serif", size: 12 },
  paper_bgcolor: "rgba(0,0,0,0)",
  plot_bgcolor: "#fff",
  legend: { orientation: "h", x: 0, y: -0.22 },
  hovermode: "closest",
};
const ACCENT = "#1f6feb";
const GB = 1e9;

async function draw(div, traces, layout, points, extra = {}) {
  const Plotly = await loadPlotly();
  await Plotly.react(div, traces, { ...BASE, ...layout }, CONFIG);
  div.dataset.points = String(points);
  for (const [key, value] of Object.entries(extra)) div.dataset[key] = String(value);
}

const title = (text) => ({ text, x: 0, xanchor: "left", font: { size: 14 } });
const axis = (text, more = {}) => ({ title: { text }, zeroline: false, automargin: true, ...more });
const empty = (text) => [{ text, xref: "paper", yref: "paper", x: 0.5, y: 0.5, showarrow: false, font: { color: "#888" } }];
const measured = (trials) => trials.filter((t) => t.state === "COMPLETE" && t.tokens_per_s !== null);
const hover = (t) => `#${t.number} ${plotText(t.layout)}`;

// Each completed trial's tokens/s by trial number, and the best so far.
export function history(div, trials) {
  const done = measured(trials);
  let best = -Infinity;
  const bestY = done.map((t) => (best = Math.max(best, t.tokens_per_s)));
  return draw(div, [
    { type: "scatter", mode: "markers", name: "trial", x: done.map((t) => t.number), y: done.map((t) => t.tokens_per_s),
      text: done.map(hover), hovertemplate: "%{text}<br>%{y:,.0f} tokens/s<extra></extra>", marker: { size: 6, color: ACCENT, opacity: 0.7 } },
    { type: "scatter", mode: "lines", name: "best so far", x: done.map((t) => t.number), y: bestY,
      line: { shape: "hv", color: "#d1242f", width: 2 }, hoverinfo: "skip" },
  ], { title: title("Optimisation history"), xaxis: axis("trial number"), yaxis: axis("tokens/s"),
       annotations: done.length ? [] : empty("no completed trial yet") }, done.length);
}

// Throughput against peak memory, the device's memory as a vertical line, and the Pareto front
// (no other trial is both faster and smaller).
export function memory(div, trials, deviceMemoryGb) {
  const done = measured(trials).filter((t) => t.peak_memory_bytes !== null);
  const front = [];
  for (const t of [...done].sort((a, b) => a.peak_memory_bytes - b.peak_memory_bytes || b.tokens_per_s - a.tokens_per_s)) {
    if (!front.length || t.tokens_per_s > front[front.length - 1].tokens_per_s) front.push(t);
  }
  const shapes = deviceMemoryGb
    ? [{ type: "line", xref: "x", yref: "paper", x0: deviceMemoryGb, x1: deviceMemoryGb, y0: 0, y1: 1, line: { color: "#888", dash: "dash" } }]
    : [];
  const annotations = deviceMemoryGb
    ? [{ x: deviceMemoryGb, y: 1, xref: "x", yref: "paper", text: `device memory ${deviceMemoryGb} GB`, showarrow: false, xanchor: "right", yanchor: "bottom", font: { size: 11, color: "#666" } }]
    : [];
  const maxX = Math.max(deviceMemoryGb || 0, ...done.map((t) => t.peak_memory_bytes / GB));
  return draw(div, [
    { type: "scatter", mode: "markers", name: "trial", x: done.map((t) => t.peak_memory_bytes / GB), y: done.map((t) => t.tokens_per_s),
      text: done.map(hover), hovertemplate: "%{text}<br>%{y:,.0f} tokens/s, %{x:.3g} GB<extra></extra>", marker: { size: 6, color: ACCENT, opacity: 0.6 } },
    { type: "scatter", mode: "lines+markers", name: "Pareto front", x: front.map((t) => t.peak_memory_bytes / GB), y: front.map((t) => t.tokens_per_s),
      text: front.map(hover), hovertemplate: "%{text}<extra>Pareto</extra>", line: { shape: "hv", color: "#d1242f" }, marker: { size: 8, color: "#d1242f" } },
  ], { title: title("Throughput vs peak memory per device"), xaxis: axis("peak memory (GB)", { range: [0, maxX * 1.05 || 1] }),
       yaxis: axis("tokens/s"), shapes, annotations: done.length ? annotations : [...annotations, ...empty("no completed trial yet")] },
  done.length, { front: front.length });
}

// The knobs of each completed trial -> its tokens/s, one line per trial.
const AC = ["none", "selective", "full"];
export function parcoords(div, trials) {
  const done = measured(trials);
  const knob = (label, key) => {
    const values = done.map((t) => t[key]);
    return { label, values, tickvals: [...new Set(values)].sort((a, b) => a - b) }; // only the values tried
  };
  const dimensions = [knob("tp", "tp"), knob("pp", "pp"), knob("dp", "dp"), knob("micro-batch", "micro_batch_size"),
    { label: "act. ckpt", values: done.map((t) => AC.indexOf(t.activation_checkpoint)), tickvals: [0, 1, 2], ticktext: AC, range: [0, 2] },
    { label: "tokens/s", values: done.map((t) => t.tokens_per_s) }];
  return draw(div, [{ type: "parcoords", dimensions, line: { color: done.map((t) => t.tokens_per_s), colorscale: "Viridis", showscale: true } }],
    { title: title("Layout knobs -> tokens/s"), margin: { l: 48, r: 48, t: 84, b: 24 },
      annotations: done.length ? [] : empty("no completed trial yet") }, done.length);
}

// Performance model against measurement; on y = x the model was right.
export function predicted(div, trials) {
  const both = measured(trials).filter((t) => t.predicted_tokens_per_s !== null);
  const values = both.flatMap((t) => [t.tokens_per_s, t.predicted_tokens_per_s]);
  const lo = Math.min(...values) * 0.9;
  const hi = Math.max(...values) * 1.1;
  return draw(div, [
    { type: "scatter", mode: "markers", name: "trial", x: both.map((t) => t.predicted_tokens_per_s), y: both.map((t) => t.tokens_per_s),
      text: both.map(hover), hovertemplate: "%{text}<br>predicted %{x:,.0f}, measured %{y:,.0f}<extra></extra>", marker: { size: 6, color: ACCENT, opacity: 0.7 } },
    { type: "scatter", mode: "lines", name: "y = x", x: both.length ? [lo, hi] : [], y: both.length ? [lo, hi] : [], line: { color: "#888", dash: "dot" }, hoverinfo: "skip" },
  ], { title: title("Predicted vs measured tokens/s"), xaxis: axis("predicted tokens/s"), yaxis: axis("measured tokens/s"),
       annotations: both.length ? [] : empty("no prediction to compare yet") }, both.length);
}

// Failed and pruned trials by kind (oom, crash, timeout, predicted_oom, ...).
export function failures(div, trials) {
  const counts = new Map();
  for (const t of trials) if (t.state === "FAIL" || t.state === "PRUNED") counts.set(t.failure_kind || "unknown", (counts.get(t.failure_kind || "unknown") || 0) + 1);
  const kinds = [...counts.keys()].sort((a, b) => counts.get(b) - counts.get(a));
  const total = kinds.reduce((n, k) => n + counts.get(k), 0);
  return draw(div, [{ type: "bar", x: kinds.map(plotText), y: kinds.map((k) => counts.get(k)), marker: { color: "#bf8700" },
    hovertemplate: "%{x}: %{y} trials<extra></extra>" }],
  { title: title("Failures by kind"), bargap: 0.5, xaxis: axis("", { type: "category" }), yaxis: axis("trials", { rangemode: "tozero", dtick: Math.max(0, ...counts.values()) <= 5 ? 1 : undefined }),
    annotations: kinds.length ? [] : empty("no failed trial") }, kinds.length, { failures: total });
}

// Best tokens/s per device and MFU against model size, one point per (model, cluster, GPUs).
export function bestBySize(div, rows) {
  const text = rows.map((r) => `${plotText(r.model)} on ${r.gpus} x ${plotText(r.cluster)}<br>${plotText(r.layout)}`);
  return draw(div, [
    { type: "scatter", mode: "markers", name: "tokens/s per device", x: rows.map((r) => r.num_params), y: rows.map((r) => r.tokens_per_s / r.gpus),
      text, hovertemplate: "%{text}<br>%{y:,.0f} tokens/s per device<extra></extra>", marker: { size: 10, color: ACCENT } },
    { type: "scatter", mode: "markers", name: "MFU", x: rows.map((r) => r.num_params), y: rows.map((r) => (r.mfu === null ? null : 100 * r.mfu)), yaxis: "y2",
      text, hovertemplate: "%{text}<br>MFU %{y:.1f} %<extra></extra>", marker: { size: 9, symbol: "diamond-open", color: "#d1242f" } },
  ], { title: title("Best per model size"), xaxis: axis("parameters", { type: "log" }), yaxis: axis("tokens/s per device", { type: "log" }),
       yaxis2: axis("MFU (%)", { overlaying: "y", side: "right", rangemode: "tozero", showgrid: false, tickmode: "auto" }),
       annotations: rows.length ? [] : empty("no completed trial in any study yet") }, rows.length);
}

export function purge(div) {
  if (window.Plotly && div) window.Plotly.purge(div);
}
