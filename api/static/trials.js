// The trial table (sort by any column, filter by text, 100 rows a page, so 5000 trials stay
// responsive) and one trial's detail.

import { el, fact, fmt, variedAxes } from "./lib.js";
import { FINISHED_TRIAL } from "./vocabulary.js";

export const FINISHED = new Set(FINISHED_TRIAL);
const ROWS_PER_PAGE = 100;
// [key, header, cell text, class]: the trial's, then one per parallel axis whose value differs
// between the study's trials (GET /api/axes, in the axis table's order), then the figures.
const FIRST = [
  ["number", "#", (t) => String(t.number), "num"],
  ["state", "state", (t) => (t.stop_reason ? `${t.state}, stopped early` : t.state), ""], // early: measured, not failed
  ["layout", "layout", (t) => t.layout, "mono"],
];
const FIGURES = [
  ["tokens_per_s", "tokens/s", (t) => fmt.int(t.tokens_per_s), "num"],
  ["tflops_per_device", "TFLOP/s per device", (t) => fmt.num(t.tflops_per_device), "num"],
  ["mfu", "MFU", (t) => fmt.pct(t.mfu), "num"],
  ["peak_memory_bytes", "peak memory", (t) => fmt.bytes(t.peak_memory_bytes), "num"],
  ["predicted_tokens_per_s", "predicted tokens/s", (t) => fmt.int(t.predicted_tokens_per_s), "num"],
  ["vs_predicted", "measured vs predicted", (t) => fmt.error(t.tokens_per_s, t.predicted_tokens_per_s), "num"],
  ["failure_kind", "failure", (t) => t.failure_kind || "", ""],
];
const axisColumn = (a) => [a.name, a.heading, (t) => String(t[a.name]), a.type === "int" ? "num" : ""];
const sortValue = (t, key) =>
  key === "vs_predicted" ? (t.tokens_per_s && t.predicted_tokens_per_s ? t.tokens_per_s / t.predicted_tokens_per_s : null) : t[key];

export class TrialTable {
  constructor(onSelect) {
    Object.assign(this, { key: "number", dir: 1, filter: "", page: 0, selected: null, trials: [], axes: [], onSelect });
    this.columns = [...FIRST, ...FIGURES];
    this.search = new Map(); // number -> the lower-case text the filter box matches
    this.thead = el("thead");
    this.tbody = el("tbody");
    this.pager = el("div", { class: "pager" });
    const box = el("input", { type: "search", placeholder: "filter: layout, state, failure kind, number…", "aria-label": "filter trials" });
    let timer = null;
    box.addEventListener("input", () => {
      clearTimeout(timer);
      timer = setTimeout(() => Object.assign(this, { filter: box.value.trim().toLowerCase(), page: 0 }).render(), 150);
    });
    this.node = el("section", { class: "trials" }, el("h2", {}, "Trials"), box,
      el("div", { class: "table-wrap" }, el("table", { class: "trials" }, this.thead, this.tbody)), this.pager);
  }

  // The parallel axes (GET /api/axes): a column for each that differs between the trials.
  setAxes(axes) {
    this.axes = axes;
  }

  update(trials, changed) {
    this.trials = trials;
    this.columns = [...FIRST, ...variedAxes(this.axes, trials).map(axisColumn), ...FIGURES];
    for (const t of changed) this.search.set(t.number, [t.number, t.state, t.stop_reason ? "stopped early" : "", t.layout, t.failure_kind, t.job_id].join(" ").toLowerCase());
    this.render();
  }

  sortBy(key) {
    Object.assign(this, { dir: this.key === key ? -this.dir : 1, key, page: 0 }).render();
  }

  rows() {
    const rows = this.filter ? this.trials.filter((t) => this.search.get(t.number).includes(this.filter)) : [...this.trials];
    const { key, dir } = this;
    return rows.sort((a, b) => {
      const x = sortValue(a, key);
      const y = sortValue(b, key);
      if (x === y) return a.number - b.number;
      if (x === null || x === undefined) return 1; // empty cells last either way
      if (y === null || y === undefined) return -1;
      return (x < y ? -1 : 1) * dir;
    });
  }

  render() {
    this.thead.replaceChildren(el("tr", {}, this.columns.map(([key, label]) => el("th", {
      class: this.key === key ? `sorted ${this.dir > 0 ? "asc" : "desc"}` : "", dataset: { key }, title: "sort",
      onclick: () => this.sortBy(key) }, label))));
    const rows = this.rows();
    const pages = Math.max(1, Math.ceil(rows.length / ROWS_PER_PAGE));
    this.page = Math.min(this.page, pages - 1);
    const shown = rows.slice(this.page * ROWS_PER_PAGE, (this.page + 1) * ROWS_PER_PAGE);
    this.tbody.replaceChildren(...shown.map((t) => el("tr", {
      class: `${t.state}${t.stop_reason ? " stopped" : ""}${this.selected === t.number ? " selected" : ""}`, tabindex: 0, dataset: { number: t.number },
      onclick: () => this.onSelect(t.number), onkeydown: (e) => e.key === "Enter" && this.onSelect(t.number) },
    this.columns.map(([, , text, cls]) => el("td", { class: cls }, text(t))))));
    const go = (n, label, name) => el("button", { type: "button", "aria-label": name, disabled: n < 0 || n >= pages || n === this.page,
      onclick: () => Object.assign(this, { page: n }).render() }, label);
    this.pager.replaceChildren(go(0, "«", "first page"), go(this.page - 1, "‹", "previous page"),
      el("span", { class: "page-info" }, `page ${this.page + 1} of ${pages} · ${rows.length} of ${this.trials.length} trials`),
      go(this.page + 1, "›", "next page"), go(pages - 1, "»", "last page"));
  }

  select(number) {
    this.selected = number;
    for (const row of this.tbody.querySelectorAll("tr.selected")) row.classList.remove("selected");
    this.tbody.querySelector(`tr[data-number="${number}"]`)?.classList.add("selected");
  }
}

// The detail panel's content: figures, config, the failure message (what the API keeps of the
// log), and the trial as the API returns it.
export function trialDetail(t) {
  const log = t.failure_message
    ? el("pre", { class: "code log" }, t.failure_message)
    : el("p", { class: "muted" }, FINISHED.has(t.state) ? "No failure: the measured figures are above." : `The trial is ${t.state}.`);
  return [
    el("h2", {}, `Trial #${t.number}`), el("p", { class: "mono" }, t.layout),
    el("dl", { class: "facts" }, fact("state", t.state), fact("tokens/s", fmt.int(t.tokens_per_s)),
      fact("predicted tokens/s", fmt.int(t.predicted_tokens_per_s)), fact("MFU", fmt.pct(t.mfu)),
      fact("TFLOP/s per device", fmt.num(t.tflops_per_device)), fact("peak memory", fmt.bytes(t.peak_memory_bytes)),
      fact("predicted memory", fmt.bytes(t.predicted_memory_bytes)),
      fact("step time (median)", t.step_time_median_s === null ? "–" : `${fmt.num(t.step_time_median_s)} s`),
      fact("failure kind", t.failure_kind || "–"), t.stop_reason ? fact("stopped early", t.stop_reason, "wide") : null,
      fact("job id", t.job_id || "–"), fact("job state", t.job_state || "–"),
      fact("attempts", String(t.attempts)), fact("started", fmt.date(t.started_at)), fact("finished", fmt.date(t.finished_at))),
    el("h3", {}, "Config"), el("table", { class: "config" }, el("tbody", {},
      Object.entries(t.config).map(([k, v]) => el("tr", {}, el("th", {}, k), el("td", { class: "mono" }, String(v)))))),
    el("h3", {}, "Log tail"),
    el("p", { class: "muted" }, "What the API keeps of the trial's log: the failure message (the trainer's error, its last "
      + "4000 characters). The log file itself stays in the worker's run directory; the API does not serve it."), log,
    el("h3", {}, "Trial JSON"), el("pre", { class: "code" }, JSON.stringify(t, null, 2)),
  ];
}
