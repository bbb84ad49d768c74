// The dashboard: hash routes #/studies, #/study/<id>, #/best over the REST API. The token (when
// the server wants one) lives in sessionStorage only and goes out as Authorization: Bearer.

import { bestBySize, chartFrame, purge } from "./charts.js";
import { api, ApiError, el, fmt, isLive, loadPlotly, modelLabel, setToken, STUDY_STATES, statusBadge, token } from "./lib.js";
import { showStudy } from "./study.js";

const view = document.getElementById("view");
let page = { id: 0, timers: [], charts: [], cleanups: [] }; // the current page; a new route stops the old one

function newPage() {
  for (const timer of page.timers) clearInterval(timer);
  for (const div of page.charts) purge(div);
  for (const cleanup of page.cleanups) cleanup();
  page = { id: page.id + 1, timers: [], charts: [], cleanups: [] };
  view.replaceChildren();
  delete view.dataset.loaded;
  document.title = "parallel-tuner";
  return page;
}

// --- token ---------------------------------------------------------------------------------

const form = document.getElementById("token-form");
const input = document.getElementById("token-input");

export function askToken(reason) {
  document.getElementById("token-reason").textContent = reason;
  form.hidden = false;
  input.focus();
}

function showTokenState() {
  document.getElementById("token-state").textContent = token() ? "token set" : "";
  document.getElementById("token-forget").hidden = !token();
}

form.addEventListener("submit", (event) => {
  event.preventDefault();
  setToken(input.value.trim());
  input.value = "";
  form.hidden = true;
  showTokenState();
  route();
});
document.getElementById("token-button").addEventListener("click", () =>
  form.hidden ? askToken("Writes (cancel) need a token; reads too when the server says so.") : (form.hidden = true));
document.getElementById("token-forget").addEventListener("click", () => {
  setToken("");
  showTokenState();
  route();
});

// One place for errors: a 401 asks for the token, anything else shows in the message bar.
export function fail(error, current) {
  if (current && current !== page) return; // the user has moved on
  if (error instanceof ApiError && error.status === 401) {
    askToken(token() ? `The token was refused: ${error.message}` : "This server needs a token to read.");
    view.replaceChildren(el("p", { class: "muted" }, "Enter the API token above to see the studies."));
    return;
  }
  message(error.message || String(error));
}

export function message(text) {
  const bar = document.getElementById("message");
  bar.textContent = text;
  bar.hidden = !text;
}

// --- studies list ----------------------------------------------------------------------------

const PAGE_SIZE = 100;

async function showStudies(current, params) {
  const status = params.get("status") || "";
  const model = params.get("model") || "";
  const offset = Number(params.get("offset") || 0);
  const go = (changes) => {
    const next = new URLSearchParams({ status, model, offset: String(offset), ...changes });
    for (const [k, v] of [...next]) if (!v || v === "0") next.delete(k);
    location.hash = `#/studies${next.size ? `?${next}` : ""}`;
  };
  const stateSelect = el("select", { "aria-label": "state", onchange: (e) => go({ status: e.target.value, offset: "0" }) },
    el("option", { value: "" }, "all states"), STUDY_STATES.map((s) => el("option", { value: s, selected: s === status }, s)));
  const modelInput = el("input", { type: "search", placeholder: "model, e.g. gpt-1.3b", value: model, list: "models", "aria-label": "model",
    onchange: (e) => go({ model: e.target.value.trim(), offset: "0" }) });
  const models = el("datalist", { id: "models" });
  const body = el("tbody");
  const pager = el("div", { class: "pager" });
  view.append(el("h1", {}, "Studies"), el("div", { class: "filters" }, stateSelect, modelInput, models),
    el("div", { class: "table-wrap" }, el("table", { class: "studies" }, el("thead", {}, el("tr", {},
      ["id", "name", "model", "cluster", "GPUs", "sampler", "state", "progress", "best tokens/s", "best MFU", "created"].map((h) => el("th", {}, h)))), body)),
    pager);

  const load = async () => {
    const query = new URLSearchParams({ limit: String(PAGE_SIZE), offset: String(offset) });
    if (status) query.set("status", status);
    if (model) query.set("model", model);
    const result = await api(`/api/studies?${query}`);
    if (current !== page) return;
    body.replaceChildren(...result.items.map(studyRow));
    if (!result.items.length) body.append(el("tr", {}, el("td", { colspan: 11, class: "muted" }, "No study matches.")));
    const known = new Set([...models.options].map((o) => o.value));
    for (const item of result.items) if (!known.has(item.model)) models.append(el("option", { value: item.model }));
    pager.replaceChildren(
      el("span", {}, `${result.total ? offset + 1 : 0}–${offset + result.items.length} of ${result.total}`),
      el("button", { type: "button", disabled: offset === 0, onclick: () => go({ offset: String(Math.max(0, offset - PAGE_SIZE)) }) }, "newer"),
      el("button", { type: "button", disabled: offset + PAGE_SIZE >= result.total, onclick: () => go({ offset: String(offset + PAGE_SIZE) }) }, "older"));
    view.dataset.loaded = "true";
    return result.items.some((s) => isLive(s.status));
  };
  // Progress of running studies moves: refresh the list every 5 s while one is pending or running.
  if (await load()) {
    current.timers.push(setInterval(() => load().catch((e) => fail(e, current)), 5000));
  }
}

function studyRow(s) {
  const link = el("a", { href: `#/study/${s.id}` }, s.name);
  const share = s.progress.budget ? Math.min(1, s.progress.finished / s.progress.budget) : 0;
  return el("tr", { dataset: { id: s.id } },
    el("td", { class: "num" }, String(s.id)), el("td", {}, link), el("td", {}, modelLabel(s)), el("td", {}, s.cluster),
    el("td", { class: "num" }, String(s.gpus)), el("td", {}, s.sampler), el("td", {}, statusBadge(s.status)),
    el("td", {}, el("span", { class: "progress" }, el("span", { style: `width:${(100 * share).toFixed(0)}%` })),
      ` ${s.progress.finished} / ${s.progress.budget}`),
    el("td", { class: "num" }, fmt.int(s.best_tokens_per_s)), el("td", { class: "num" }, fmt.pct(s.best_mfu)),
    el("td", {}, fmt.date(s.created_at)));
}

// --- best per model size ---------------------------------------------------------------------

async function showBest(current) {
  const rows = await api("/api/best");
  if (current !== page) return;
  rows.sort((a, b) => a.num_params - b.num_params || a.gpus - b.gpus);
  const { node: figure, plot: chart } = chartFrame("best", "Tokens/s per device and MFU by model size", true);
  current.charts.push(chart);
  view.append(el("h1", {}, "Best layout per model size"),
    el("p", { class: "muted" }, "The fastest measured layout per (model, cluster, GPUs) across all studies."), figure,
    el("div", { class: "table-wrap" }, el("table", { class: "best" }, el("thead", {}, el("tr", {}, ["model", "parameters", "cluster", "GPUs", "tokens/s", "tokens/s per device",
      "TFLOP/s per device", "MFU", "peak memory", "layout", "study"].map((h) => el("th", {}, h)))),
    el("tbody", {}, rows.map((r) => el("tr", {}, el("td", {}, modelLabel(r)), el("td", { class: "num" }, fmt.params(r.num_params)),
      el("td", {}, r.cluster), el("td", { class: "num" }, String(r.gpus)), el("td", { class: "num" }, fmt.int(r.tokens_per_s)),
      el("td", { class: "num" }, fmt.int(r.tokens_per_s / r.gpus)), el("td", { class: "num" }, fmt.num(r.tflops_per_device)),
      el("td", { class: "num" }, fmt.pct(r.mfu)), el("td", { class: "num" }, fmt.bytes(r.peak_memory_bytes)),
      el("td", { class: "mono" }, r.layout), el("td", {}, el("a", { href: `#/study/${r.study_id}` }, `${r.study} #${r.trial_number}`))))))));
  view.append(predictionSection());
  view.dataset.loaded = "true";
  await bestBySize(chart, rows);
}

// Sizes nobody measured: the planner's prediction on each calibrated cluster, apart from the
// measured rows above, with the calibration it used and the command that confirms it.
function predictionSection() {
  const out = el("div", { class: "predicted" });
  const select = el("select", { "aria-label": "model preset to predict", onchange: async () => {
    out.replaceChildren();
    if (!select.value) return;
    const rows = await api(`/api/best?model=${encodeURIComponent(select.value)}`);
    const predicted = rows.filter((r) => r.kind === "predicted");
    if (!predicted.length) {
      out.append(el("p", { class: "muted" }, rows.length ? `${select.value} is measured: see the table above.`
        : `No prediction for ${select.value}: no cluster has a calibration (a finished study fits one).`));
      return;
    }
    out.append(el("div", { class: "table-wrap" }, el("table", { class: "best predicted" },
      el("thead", {}, el("tr", {}, ["model", "parameters", "cluster", "GPUs", "predicted tokens/s", "predicted MFU", "memory",
        "layout", "calibration", "confirm with"].map((h) => el("th", {}, h)))),
      el("tbody", {}, predicted.map((r) => el("tr", {}, el("td", {}, `${modelLabel(r)} (predicted)`),
        el("td", { class: "num" }, fmt.params(r.num_params)), el("td", {}, r.cluster), el("td", { class: "num" }, String(r.gpus)),
        el("td", { class: "num" }, fmt.int(r.predicted_tokens_per_s)), el("td", { class: "num" }, fmt.pct(r.predicted_mfu)),
        el("td", { class: "num" }, fmt.bytes(r.predicted_memory_bytes)), el("td", { class: "mono" }, r.layout),
        el("td", {}, `${r.calibration.num_points} measurements, rms log error ${r.calibration.rms_log_error.toFixed(2)}`),
        el("td", { class: "mono" }, r.confirm)))))));
  } }, el("option", { value: "" }, "choose a model size"), (dashboardConfig.model_presets || []).map((m) => el("option", { value: m }, m)));
  return el("section", {}, el("h2", {}, "Predicted for sizes not measured yet"),
    el("p", { class: "muted" }, "Not measurements: the performance model with each cluster's latest calibration."), select, out);
}

// --- routes ----------------------------------------------------------------------------------

export function route() {
  const current = newPage();
  message("");
  const [path, query = ""] = location.hash.replace(/^#/, "").split("?");
  const parts = path.split("/").filter(Boolean);
  for (const link of document.querySelectorAll("nav a")) link.classList.toggle("active", link.dataset.nav === (parts[0] || "studies"));
  let shown;
  if (parts[0] === "study" && /^\d+$/.test(parts[1] || "")) shown = showStudy(current, Number(parts[1]), { page: () => page, fail, message, askToken });
  else if (parts[0] === "best") shown = showBest(current);
  else shown = showStudies(current, new URLSearchParams(query));
  if (parts[0] === "study" || parts[0] === "best") loadPlotly().catch((e) => fail(e, current)); // requests are out
  shown.catch((e) => fail(e, current));
}

let dashboardConfig = {}; // /dashboard/config: read_auth, model_presets

async function start() {
  showTokenState();
  // Ask for the token before the first read when the server needs one (rather than after a 401).
  dashboardConfig = await fetch("/dashboard/config").then((r) => r.json()).catch(() => ({}));
  if (dashboardConfig.read_auth && !token()) {
    askToken("This server needs a token to read.");
    view.replaceChildren(el("p", { class: "muted" }, "Enter the API token above to see the studies."));
  } else {
    route();
  }
  window.addEventListener("hashchange", route);
}

start();
