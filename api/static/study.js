// One study: its figures, five charts (the model's predictions beside its calibrated model's once
// the study has ended), the trial table (sort, filter, 100 rows a page) with a detail panel,
// launch-config export, cancel, and live updates while the study is pending or running
// (GET /trials?after=<n> every 2 s: new trials, and the ones still waiting or running).

import * as charts from "./charts.js";
import { api, el, fact, fmt, isCancellable, isLive, modelLabel, statusBadge, token } from "./lib.js";
import { FINISHED, TrialTable, trialDetail } from "./trials.js";
import { STUDY } from "./vocabulary.js";

const POLL_MS = 2000;
const FETCH_LIMIT = 10000; // the API's maximum: one request up to 10k trials

async function fetchTrials(id, after) {
  const out = [];
  for (;;) {
    const page = await api(`/api/studies/${id}/trials?after=${after}&limit=${FETCH_LIMIT}`);
    for (const item of page.items) out.push(item);
    if (page.items.length < FETCH_LIMIT) return out;
    after = page.last_number;
  }
}

export async function showStudy(current, id, ctx) {
  const view = document.getElementById("view");
  const byNumber = new Map();
  let study = null;
  let trials = [];

  // New and changed trials in; the table re-rendered; true when anything changed.
  const merge = (items) => {
    const changed = items.filter((item) => {
      const old = byNumber.get(item.number);
      return !old || JSON.stringify(old) !== JSON.stringify(item);
    });
    for (const item of changed) byNumber.set(item.number, item);
    if (changed.length) {
      trials = [...byNumber.values()].sort((a, b) => a.number - b.number);
      table.update(trials, changed);
    }
    return changed.length > 0;
  };

  // --- skeleton ---
  const head = el("section", { class: "study-head" });
  const exportBox = el("section", { class: "export", hidden: true });
  const frames = Object.fromEntries([["history", "Optimisation history"], ["memory", "Throughput vs peak memory per device"],
    ["predicted", "Predicted vs measured tokens/s"], ["failures", "Failures by kind"], ["parcoords", "Layout knobs → tokens/s"]]
    .map(([name, heading]) => [name, charts.chartFrame(name, heading, name === "parcoords")]));
  const divs = Object.fromEntries(Object.entries(frames).map(([name, f]) => [name, f.plot]));
  current.charts.push(...Object.values(divs));
  const table = new TrialTable((number) => select(number));
  const detail = el("aside", { class: "detail", hidden: true, "aria-label": "trial detail" });
  view.append(head, exportBox, el("section", { class: "charts" }, Object.values(frames).map((f) => f.node)), table.node, detail);

  // --- header: figures, cancel, export ---
  function renderHead() {
    const best = study.best;
    const cancel = isCancellable(study.status)
      ? el("button", { type: "button", class: "danger", onclick: cancelStudy }, cancelArmed ? "Really cancel? Click again" : "Cancel study")
      : null;
    const exports = best
      ? el("span", { class: "buttons" }, "Export the best layout: ",
        [["torchtitan", "torchtitan"], ["megatron", "Megatron-LM"], ["sbatch", "sbatch"]].map(([format, label]) =>
          el("button", { type: "button", dataset: { format }, onclick: () => showExport(format, label) }, label)))
      : null;
    const counts = Object.entries(study.progress.by_state).map(([s, n]) => `${n} ${s}`).join(", ");
    head.replaceChildren(
      el("h1", {}, study.name, " ", statusBadge(study.status), isLive(study.status) ? el("span", { class: "live" }, "live") : null),
      el("dl", { class: "facts" },
        fact("model", modelLabel(study)), fact("cluster", study.cluster), fact("GPUs", String(study.gpus)), fact("sampler", study.sampler),
        fact("progress", `${study.progress.finished} / ${study.progress.budget} trials${counts ? ` (${counts})` : ""}`),
        fact("best tokens/s", fmt.int(study.best_tokens_per_s)), fact("best MFU", fmt.pct(study.best_mfu)),
        fact("best layout", best ? `#${best.number} ${best.layout}` : "–", "wide"),
        ...payoffFacts(study.payoff),
        fact("device memory", fmt.bytes(study.spec.cluster?.device_memory_gb * 1e9 || null)),
        fact("created", fmt.date(study.created_at)), fact("finished", fmt.date(study.finished_at)),
        study.lease ? fact("held by", `${study.lease.owner} (lease ${study.lease.expires_in_s >= 0
          ? `renewed ${Math.round(study.lease.renewed_s_ago)} s ago` : `expired ${Math.round(-study.lease.expires_in_s)} s ago`})`, "wide") : null,
        study.reason ? fact(study.status === STUDY.FAILED ? "error" : "reason", study.reason, "wide") : null),
      el("div", { class: "actions" }, cancel, exports));
  }

  // What tuning cost and what it bought (tuner/payoff.py): one glance.
  function payoffFacts(p) {
    if (!p) return [];
    const label = { first_guess: "vs the model's first guess", median: "vs the median layout" };
    return [fact("tuning cost", `${p.tuning_device_hours.toPrecision(3)} device-hours`, "payoff"),
      ...p.baselines.map((b) => fact(label[b.name], `${b.speedup.toFixed(2)}× ` + (b.payback_minutes === null ? "(no gain)"
        : `— pays back after ${b.payback_minutes.toPrecision(3)} min of training`)
        + (b.saved_device_hours ? `, saves ${b.saved_device_hours.toPrecision(3)} device-hours over the run` : ""), "payoff wide"))];
  }

  let cancelArmed = false; // two clicks, no blocking dialog; the header is redrawn by every poll
  async function cancelStudy() {
    if (!token()) return ctx.askToken("Cancelling a study needs the API token.");
    if (!cancelArmed) {
      cancelArmed = true;
      renderHead();
      setTimeout(() => { cancelArmed = false; if (study && current === ctx.page()) renderHead(); }, 10_000);
      return;
    }
    cancelArmed = false;
    try {
      await api(`/api/studies/${id}/cancel`, { method: "POST" });
      await poll();
    } catch (e) {
      if (e.status === 401) ctx.askToken(`Cancelling needs a valid token: ${e.message}`);
      else ctx.message(e.message);
    }
  }

  async function showExport(format, label) {
    const text = await api(`/api/studies/${id}/export?format=${format}`, { text: true }).catch((e) => ctx.fail(e, current));
    if (text === undefined || current !== ctx.page()) return;
    const pre = el("pre", { class: "code" }, text);
    const copy = el("button", { type: "button", onclick: async () => {
      try {
        await navigator.clipboard.writeText(text);
        copy.textContent = "copied";
      } catch { // no clipboard permission: select it for Ctrl+C
        getSelection().selectAllChildren(pre);
        copy.textContent = "selected: press Ctrl+C";
      }
    } }, "copy");
    exportBox.replaceChildren(el("h2", {}, `${label} launch config for #${study.best.number} ${study.best.layout}`), copy,
      el("button", { type: "button", onclick: () => (exportBox.hidden = true) }, "close"), pre);
    exportBox.dataset.format = format;
    exportBox.hidden = false;
  }

  function select(number) {
    table.select(number);
    showDetail();
  }

  function showDetail() {
    const t = byNumber.get(table.selected);
    if (!t) return;
    detail.replaceChildren(
      el("button", { type: "button", class: "close", "aria-label": "close", onclick: () => (detail.hidden = true) }, "×"),
      ...trialDetail(t));
    detail.dataset.number = String(t.number);
    detail.hidden = false;
  }

  // --- charts: the first one alone, then one per frame (the page paints and takes clicks in
  // between); each redrawn only when the trials changed. Parallel coordinates (WebGL: seconds for
  // thousands of lines where the browser renders WebGL in software) waits until it is scrolled to.
  let version = 0; // bumped by every merge that changed a trial
  const drawnAt = {};
  let parcoordsWanted = false;
  const draws = {
    history: () => charts.history(divs.history, trials),
    memory: () => charts.memory(divs.memory, trials, study.spec.cluster?.device_memory_gb),
    predicted: () => charts.predicted(divs.predicted, trials, calibration),
    failures: () => charts.failures(divs.failures, trials),
    parcoords: () => charts.parcoords(divs.parcoords, trials, axes),
  };
  let drawing = null;
  let again = false;
  function renderCharts() {
    if (drawing) {
      again = true;
      return drawing;
    }
    drawing = (async () => {
      try {
        do {
          again = false;
          for (const [name, draw] of Object.entries(draws)) {
            if (drawnAt[name] === version || (name === "parcoords" && !parcoordsWanted) || current !== ctx.page()) continue;
            if (name !== "history") await new Promise((resolve) => requestAnimationFrame(() => setTimeout(resolve)));
            const drawn = version;
            await draw();
            drawnAt[name] = drawn;
            if (!performance.getEntriesByName(`tuner:${name}`).length) performance.mark(`tuner:${name}`);
          }
        } while (again);
      } finally {
        drawing = null;
      }
    })();
    return drawing;
  }
  const onScreen = new IntersectionObserver((entries) => {
    if (!entries.some((e) => e.isIntersecting)) return;
    onScreen.disconnect();
    parcoordsWanted = true;
    renderCharts().catch((e) => ctx.fail(e, current));
  });

  // The study's calibrated model: fitted when the study ends, read once more when it has.
  let calibration = null;
  let axes = []; // the parallel axes (GET /api/axes): the parallel coordinates' dimensions
  const readCalibration = () => api(`/api/studies/${id}/calibration`);

  // --- live updates ---
  let lastNumber = -1;
  let polling = false;
  async function poll() {
    if (polling || current !== ctx.page() || document.hidden) return; // a background tab waits
    polling = true;
    try {
      // From the oldest trial still waiting or running: new trials and the ones that moved on.
      const open = trials.find((t) => !FINISHED.has(t.state));
      const after = open ? open.number - 1 : lastNumber;
      let [next, items] = await Promise.all([api(`/api/studies/${id}`), fetchTrials(id, after)]);
      if (!isLive(next.status)) items = items.concat(await fetchTrials(id, after)); // trials finished with it
      if (current !== ctx.page()) return;
      study = next;
      renderHead();
      if (items.length) lastNumber = Math.max(lastNumber, items[items.length - 1].number);
      let fitted = false; // the study has ended: its calibration, read once
      if (!isLive(study.status) && !calibration?.calibration) {
        calibration = await readCalibration();
        fitted = calibration.calibration !== null;
      }
      if (current !== ctx.page()) return;
      if (merge(items) || fitted) {
        version += 1;
        if (!detail.hidden && items.some((t) => t.number === table.selected)) showDetail();
        renderCharts().catch((e) => ctx.fail(e, current));
      }
      if (!isLive(study.status)) for (const timer of current.timers.splice(0)) clearInterval(timer);
    } finally {
      polling = false;
    }
  }

  // --- first load: study and all its trials in parallel; the table before plotly is ready ---
  const [first, items, fit, axesRead] = await Promise.all([api(`/api/studies/${id}`), fetchTrials(id, -1), readCalibration(),
    api("/api/axes")]);
  if (current !== ctx.page()) return;
  study = first;
  calibration = fit;
  axes = axesRead;
  table.setAxes(axes);
  merge(items);
  performance.mark("tuner:trials-loaded");
  lastNumber = trials.length ? trials[trials.length - 1].number : -1;
  document.title = `${study.name} · parallel-tuner`;
  renderHead();
  if (!trials.length) table.update(trials, []);
  view.dataset.loaded = "true";
  if (isLive(study.status)) current.timers.push(setInterval(() => poll().catch((e) => ctx.fail(e, current)), POLL_MS));
  await renderCharts();
  onScreen.observe(divs.parcoords);
  current.cleanups.push(() => onScreen.disconnect());
}
