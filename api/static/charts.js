// The study's charts and the best-per-model-size chart (plotly.js, served locally). Each chart
// sets data-points on its plot's div after plotly has drawn it: the number of marks of its main
// trace, so tests can compare what was drawn with the database.

import { el, fmt, loadPlotly, plotText, UNITS, unitOf, variedAxes } from "./lib.js";
import { FINISHED_TRIAL, TRIAL } from "./vocabulary.js";

// Headings and notes are HTML above the plot (chartFrame), not plotly titles: the mode bar, shown
// while the pointer is over a chart, sits in the plot's top margin and covers nothing.
const CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["select2d", "lasso2d"] };
const BASE = {
  margin: { l: 64, r: 16, t: 30, b: 48 },
  font: { family: "system-ui, sans-serif", size: 12 },
  paper_bgcolor: "rgba(0,0,0,0)",
  plot_bgcolor: "#fff",
  legend: { orientation: "h", x: 0, y: -0.3 }, // below the x axis's title
  hovermode: "closest",
};
const ACCENT = "#1f6feb";
const CALIBRATED = "#1a7f37";
const GB = 1e9;
// The device's memory is drawn while the largest peak fills at least 1/DEVICE_LINE_SPAN of the axis
// up to it; beyond that the axis fits the trials and a note gives the device's size.
const DEVICE_LINE_SPAN = 4;

// A chart's figure: its heading, a note (hidden until a chart sets one) and the plot's div, which
// carries data-chart and, once drawn, data-points.
export function chartFrame(name, heading, wide = false) {
  const plot = el("div", { class: "plot", dataset: { chart: name } });
  const node = el("figure", { class: wide ? "chart wide" : "chart" }, el("h2", {}, heading),
    el("p", { class: "chart-note", hidden: true }), plot);
  return { node, plot };
}

function setNote(div, text) {
  const note = div.parentElement?.querySelector(".chart-note");
  if (!note) return;
  note.textContent = text || "";
  note.hidden = !text;
}

async function draw(div, traces, layout, points, extra = {}, note = "") {
  const Plotly = await loadPlotly();
  setNote(div, note);
  await Plotly.react(div, traces, { ...BASE, ...layout }, CONFIG);
  div.dataset.points = String(points);
  for (const [key, value] of Object.entries(extra)) div.dataset[key] = String(value);
}

const axis = (text, more = {}) => ({ title: { text }, zeroline: false, automargin: true, ...more });
// A log axis over the values (padded to a decade at least) ticked at 1, 2 and 5 x 10^n (powers of
// ten alone past 4 decades) and labelled by `format`, d3's SI by default (2k, 5k, 10k), rather than
// plotly's bare digits between the powers of ten.
function logAxis(text, values, format) {
  let [lo, hi] = [Math.log10(Math.min(...values)), Math.log10(Math.max(...values))];
  const pad = Math.max(0.1, (1 - (hi - lo)) / 2);
  [lo, hi] = [lo - pad, hi + pad];
  const ticks = [];
  for (let e = Math.floor(lo); e <= Math.ceil(hi); e += 1) {
    for (const m of hi - lo > 4 ? [1] : [1, 2, 5]) if (Math.log10(m * 10 ** e) >= lo && Math.log10(m * 10 ** e) <= hi) ticks.push(m * 10 ** e);
  }
  const labels = format ? { ticktext: ticks.map(format) } : { tickformat: "~s" };
  return axis(text, { type: "log", range: [lo, hi], tickvals: ticks, ...labels });
}
const empty = (text) => [{ text, xref: "paper", yref: "paper", x: 0.5, y: 0.5, showarrow: false, font: { color: "#888" } }];
const measured = (trials) => trials.filter((t) => t.state === TRIAL.COMPLETE && t.tokens_per_s !== null);
// Pruned while running as too slow: a measurement of fewer steps (its partial tokens/s), not a failure.
const stoppedEarly = (trials) => trials.filter((t) => t.stop_reason && t.tokens_per_s !== null);
const hover = (t) => `#${t.number} ${plotText(t.layout)}`;
// A stored prediction's three largest terms, each with its share of the predicted step (the terms
// add up to it: tuner/cost/terms.py StepTerms); empty for trials stored before the terms existed.
const topTerms = (t) => {
  if (!t.predicted_terms || !t.predicted_step_time_s) return "";
  const top = Object.entries(t.predicted_terms).filter(([, v]) => v > 0).sort((a, b) => b[1] - a[1]).slice(0, 3);
  return "<br>predicted step: " + top.map(([k, v]) => `${k.replace(/_s$/, "").replaceAll("_", " ")} ${(100 * v / t.predicted_step_time_s).toFixed(0)} %`).join(", ");
};

// Each completed trial's tokens/s by trial number, and the best so far; trials stopped early as too
// slow apart, at the tokens/s they measured before they stopped (never a best).
export function history(div, trials) {
  const done = measured(trials);
  const stopped = stoppedEarly(trials);
  let best = -Infinity;
  const bestY = done.map((t) => (best = Math.max(best, t.tokens_per_s)));
  return draw(div, [
    { type: "scatter", mode: "markers", name: "trial", x: done.map((t) => t.number), y: done.map((t) => t.tokens_per_s),
      text: done.map(hover), hovertemplate: "%{text}<br>%{y:,.0f} tokens/s<extra></extra>", marker: { size: 6, color: ACCENT, opacity: 0.7 } },
    { type: "scatter", mode: "lines", name: "best so far", x: done.map((t) => t.number), y: bestY,
      line: { shape: "hv", color: "#d1242f", width: 2 }, hoverinfo: "skip" },
    { type: "scatter", mode: "markers", name: "stopped early (too slow)", x: stopped.map((t) => t.number), y: stopped.map((t) => t.tokens_per_s),
      text: stopped.map(hover), hovertemplate: "%{text}<br>%{y:,.0f} tokens/s before it stopped<extra>stopped early</extra>",
      marker: { size: 7, symbol: "circle-open", color: "#57606a" }, showlegend: stopped.length > 0 },
  ], { xaxis: axis("trial number"), yaxis: axis("tokens/s"),
       annotations: done.length || stopped.length ? [] : empty("no completed trial yet") }, done.length, { stopped: stopped.length });
}

// Throughput against peak memory, in the unit of the trials' peaks, and the Pareto front (no other
// trial is both faster and smaller). The device's memory is a vertical line when it is in range.
export function memory(div, trials, deviceMemoryGb) {
  const done = measured(trials).filter((t) => t.peak_memory_bytes !== null);
  const front = [];
  for (const t of [...done].sort((a, b) => a.peak_memory_bytes - b.peak_memory_bytes || b.tokens_per_s - a.tokens_per_s)) {
    if (!front.length || t.tokens_per_s > front[front.length - 1].tokens_per_s) front.push(t);
  }
  const peak = Math.max(0, ...done.map((t) => t.peak_memory_bytes));
  const device = deviceMemoryGb ? deviceMemoryGb * GB : 0;
  const deviceLine = !device ? "none" : !done.length || device <= DEVICE_LINE_SPAN * peak ? "shown" : "off-scale";
  const top = Math.max(peak, deviceLine === "shown" ? device : 0);
  const [unit, size] = unitOf(top || GB, UNITS.bytes);
  const x = (t) => t.peak_memory_bytes / size;
  const shapes = deviceLine === "shown"
    ? [{ type: "line", xref: "x", yref: "paper", x0: device / size, x1: device / size, y0: 0, y1: 1, line: { color: "#888", dash: "dash" } }]
    : [];
  const annotations = deviceLine === "shown"
    ? [{ x: device / size, y: 1, xref: "x", yref: "paper", text: `device memory ${fmt.bytes(device)}`, showarrow: false,
      xanchor: "right", yanchor: "bottom", font: { size: 11, color: "#666" } }]
    : [];
  const note = deviceLine === "off-scale"
    ? `Device memory, ${fmt.bytes(device)}, is off the scale: the largest peak, ${fmt.bytes(peak)}, is ${fmt.num((100 * peak) / device, 2)} % of it.`
    : "";
  return draw(div, [
    { type: "scatter", mode: "markers", name: "trial", x: done.map(x), y: done.map((t) => t.tokens_per_s),
      text: done.map(hover), hovertemplate: `%{text}<br>%{y:,.0f} tokens/s, %{x:.3g} ${unit}<extra></extra>`, marker: { size: 6, color: ACCENT, opacity: 0.6 } },
    { type: "scatter", mode: "lines+markers", name: "Pareto front", x: front.map(x), y: front.map((t) => t.tokens_per_s),
      text: front.map(hover), hovertemplate: "%{text}<extra>Pareto</extra>", line: { shape: "hv", color: "#d1242f" }, marker: { size: 8, color: "#d1242f" } },
  ], { xaxis: axis(`peak memory per device (${unit})`, { range: [0, (top / size) * 1.08 || 1] }), yaxis: axis("tokens/s"), shapes,
       annotations: done.length ? annotations : [...annotations, ...empty("no completed trial yet")] },
  done.length, { front: front.length, unit, deviceLine }, note);
}

// The knobs of each completed trial -> its tokens/s, one line per trial: a dimension for every
// parallel axis (GET /api/axes, trainer/contract/axes.py) whose value differs between trials.
export function parcoords(div, trials, axes) {
  const done = measured(trials);
  const dimension = (a) => {
    const values = done.map((t) => t[a.name]);
    if (a.choices.length) { // categories at their index, named
      const names = a.choices.map(String);
      return { label: a.label, values: values.map((v) => names.indexOf(String(v))), tickvals: names.map((_, i) => i),
               ticktext: names, range: [0, names.length - 1] };
    }
    return { label: a.label, values, tickvals: [...new Set(values)].sort((x, y) => x - y) }; // only the values tried
  };
  const dimensions = [...variedAxes(axes, done).map(dimension), { label: "tokens/s", values: done.map((t) => t.tokens_per_s) }];
  return draw(div, [{ type: "parcoords", dimensions, line: { color: done.map((t) => t.tokens_per_s), colorscale: "Viridis", showscale: true } }],
    { margin: { l: 48, r: 48, t: 48, b: 24 },
      annotations: done.length ? [] : empty("no completed trial yet") }, done.length);
}

// The model against measurement, on log axes (its errors are ratios): each trial as predicted when
// it was proposed and, once the study has ended and calibrated the model, as the calibrated model
// predicts it, a grey segment joining the two. On y = x the model was right.
export function predicted(div, trials, calibration) {
  const both = measured(trials).filter((t) => t.predicted_tokens_per_s !== null);
  const fitted = calibration?.trials || [];
  const values = [...both.flatMap((t) => [t.tokens_per_s, t.predicted_tokens_per_s]),
    ...fitted.map((t) => t.calibrated_tokens_per_s)].filter((v) => v > 0);
  const diagonal = values.length ? [Math.min(...values) / 10, Math.max(...values) * 10] : []; // beyond the axes' padding
  const off = (p, m) => `${p >= m ? "+" : ""}${(100 * (p / m - 1)).toFixed(0)} %`;
  const proposed = new Map(both.map((t) => [t.number, t.predicted_tokens_per_s]));
  const moves = fitted.filter((t) => proposed.has(t.number))
    .flatMap((t) => [[proposed.get(t.number), t.tokens_per_s], [t.calibrated_tokens_per_s, t.tokens_per_s], [null, null]]);
  const note = calibration?.calibration
    ? `Median error of the prediction: ${fmt.pct(calibration.median_error_proposed)} when proposed, ${fmt.pct(calibration.median_error_calibrated)} `
      + `with the study's calibration (fitted to these ${calibration.calibration.num_points} measured trials: in-sample).`
    : "No calibrated model yet: a study fits one when it ends, from 3 or more measured trials.";
  return draw(div, [
    { type: "scatter", mode: "lines", name: "moved by the calibration", x: moves.map((m) => m[0]), y: moves.map((m) => m[1]),
      line: { color: "#c0c6cc", width: 1 }, hoverinfo: "skip", showlegend: moves.length > 0 },
    { type: "scatter", mode: "markers", name: "predicted when proposed", x: both.map((t) => t.predicted_tokens_per_s), y: both.map((t) => t.tokens_per_s),
      text: both.map((t) => `${hover(t)}<br>predicted ${fmt.int(t.predicted_tokens_per_s)} when proposed (${off(t.predicted_tokens_per_s, t.tokens_per_s)})${topTerms(t)}`),
      hovertemplate: "%{text}<br>measured %{y:,.0f}<extra></extra>", marker: { size: 7, color: ACCENT, opacity: 0.75 } },
    { type: "scatter", mode: "markers", name: "calibrated model", x: fitted.map((t) => t.calibrated_tokens_per_s), y: fitted.map((t) => t.tokens_per_s),
      text: fitted.map((t) => `${hover(t)}<br>calibrated model ${fmt.int(t.calibrated_tokens_per_s)} (${off(t.calibrated_tokens_per_s, t.tokens_per_s)})`),
      hovertemplate: "%{text}<br>measured %{y:,.0f}<extra></extra>", marker: { size: 8, symbol: "diamond", color: CALIBRATED } },
    { type: "scatter", mode: "lines", name: "y = x", x: diagonal, y: diagonal,
      line: { color: "#888", dash: "dot" }, hoverinfo: "skip" },
  ], { xaxis: values.length ? logAxis("predicted tokens/s", values) : axis("predicted tokens/s", { type: "log" }),
       yaxis: values.length ? logAxis("measured tokens/s", values) : axis("measured tokens/s", { type: "log" }),
       annotations: both.length || fitted.length ? [] : empty("no prediction to compare yet") },
  both.length, { calibrated: fitted.length }, note);
}

// Failed trials, and trials pruned before they ran, by kind (oom, crash, timeout, predicted_oom, ...).
// A trial stopped early as too slow has no failure kind: it is a measurement (the history chart).
export function failures(div, trials) {
  const counts = new Map();
  for (const t of trials) if (t.failure_kind && FINISHED_TRIAL.includes(t.state)) counts.set(t.failure_kind, (counts.get(t.failure_kind) || 0) + 1);
  const kinds = [...counts.keys()].sort((a, b) => counts.get(b) - counts.get(a));
  const total = kinds.reduce((n, k) => n + counts.get(k), 0);
  const stopped = stoppedEarly(trials).length;
  const note = stopped ? `Not counted: ${stopped} trial${stopped > 1 ? "s" : ""} stopped early as too slow (measurements, in the optimisation history).` : "";
  return draw(div, [{ type: "bar", x: kinds.map(plotText), y: kinds.map((k) => counts.get(k)), marker: { color: "#bf8700" },
    hovertemplate: "%{x}: %{y} trials<extra></extra>" }],
  { bargap: 0.5, xaxis: axis("", { type: "category" }), yaxis: axis("trials", { rangemode: "tozero", dtick: Math.max(0, ...counts.values()) <= 5 ? 1 : undefined }),
    annotations: kinds.length ? [] : empty("no failed trial") }, kinds.length, { failures: total, stopped }, note);
}

// Best tokens/s per device and MFU against model size, one point per (model, cluster, GPUs).
export function bestBySize(div, rows) {
  const text = rows.map((r) => `${plotText(r.model)} on ${r.gpus} x ${plotText(r.cluster)}<br>${plotText(r.layout)}`);
  return draw(div, [
    { type: "scatter", mode: "markers", name: "tokens/s per device", x: rows.map((r) => r.num_params), y: rows.map((r) => r.tokens_per_s / r.gpus),
      text, hovertemplate: "%{text}<br>%{y:,.0f} tokens/s per device<extra></extra>", marker: { size: 10, color: ACCENT } },
    { type: "scatter", mode: "markers", name: "MFU", x: rows.map((r) => r.num_params), y: rows.map((r) => (r.mfu === null ? null : 100 * r.mfu)), yaxis: "y2",
      text, hovertemplate: "%{text}<br>MFU %{y:.1f} %<extra></extra>", marker: { size: 9, symbol: "diamond-open", color: "#d1242f" } },
  ], { xaxis: rows.length ? logAxis("parameters", rows.map((r) => r.num_params), fmt.params) : axis("parameters", { type: "log" }),
       yaxis: rows.length ? logAxis("tokens/s per device", rows.map((r) => r.tokens_per_s / r.gpus)) : axis("tokens/s per device", { type: "log" }),
       yaxis2: axis("MFU (%)", { overlaying: "y", side: "right", rangemode: "tozero", showgrid: false, tickmode: "auto" }),
       annotations: rows.length ? [] : empty("no completed trial in any study yet") }, rows.length);
}

export function purge(div) {
  if (window.Plotly && div) window.Plotly.purge(div);
}
