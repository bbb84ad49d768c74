// Shared by the pages: the API client (bearer token from sessionStorage), DOM building (text
// only: names are data, never HTML), number formats, the promise that plotly.js has loaded, and the
// words for states (vocabulary.js: written by the server from tuner/outcome.py's enums).

import { CANCELLABLE_STUDY, LIVE_STUDY, STUDY_STATES } from "./vocabulary.js";

const TOKEN_KEY = "tuner.token";

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export function token() {
  return sessionStorage.getItem(TOKEN_KEY) || "";
}

export function setToken(value) {
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  else sessionStorage.removeItem(TOKEN_KEY);
}

// Every request carries the token when there is one; errors come back in the API's one shape.
export async function api(path, { method = "GET", text = false } = {}) {
  const headers = token() ? { Authorization: `Bearer ${token()}` } : {};
  const response = await fetch(path, { method, headers });
  if (!response.ok) {
    let error = {};
    try {
      error = (await response.json()).error || {};
    } catch {
      // not the API's JSON (a proxy's page): keep the status line
    }
    throw new ApiError(response.status, error.code || "http_error",
      error.message || `${response.status} ${response.statusText}`);
  }
  return text ? response.text() : response.json();
}

// el("td", {class: "num", onclick: f}, "text", child, ...): strings become text nodes.
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(node.dataset, value);
    else node.setAttribute(key, value === true ? "" : value);
  }
  node.append(...children.flat().filter((c) => c !== null && c !== undefined && c !== false));
  return node;
}

// Sizes in the unit of their magnitude, decimal as the API counts them: 230 K parameters, 3.2 MB.
export const UNITS = {
  bytes: [["GB", 1e9], ["MB", 1e6], ["kB", 1e3], ["B", 1]],
  params: [["B", 1e9], ["M", 1e6], ["K", 1e3], ["", 1]],
};

// [unit, size]: the largest unit of `units` not above x (the smallest one below it).
export const unitOf = (x, units) => units.find(([, size]) => Math.abs(x) >= size) || units[units.length - 1];

function scaled(x, units) {
  const [unit, size] = unitOf(Number(x.toPrecision(3)), units); // 999,999 B is 1 MB, not 1,000 kB
  const value = size === 1 ? Math.round(x) : Number((x / size).toPrecision(3));
  return `${value.toLocaleString("en-US")}${unit ? ` ${unit}` : ""}`;
}

export const fmt = {
  int: (x) => (x === null || x === undefined ? "–" : Math.round(x).toLocaleString("en-US")),
  num: (x, digits = 3) => (x === null || x === undefined ? "–" : Number(x.toPrecision(digits)).toLocaleString("en-US")),
  pct: (x) => (x === null || x === undefined ? "–" : `${(100 * x).toFixed(1)} %`),
  bytes: (x) => (x === null || x === undefined ? "–" : scaled(x, UNITS.bytes)),
  params: (x) => (x === null || x === undefined ? "–" : scaled(x, UNITS.params)),
  date: (x) => (x ? new Date(x).toLocaleString() : "–"),
  // measured / predicted - 1, signed: "+12 %" means faster than the model said.
  error: (measured, predicted) =>
    measured && predicted ? `${measured >= predicted ? "+" : ""}${(100 * (measured / predicted - 1)).toFixed(0)} %` : "–",
};

// Plotly renders a subset of HTML in its labels; data goes in as plain text.
export const plotText = (s) => String(s).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");

// plotly.js (4.8 MB) is loaded on first use, after the page has sent its API requests, so the
// browser parses it while the server answers (rather than before the requests go out).
let plotly = null;
export function loadPlotly() {
  plotly ??= new Promise((resolve, reject) => {
    if (window.Plotly) return resolve(window.Plotly);
    const script = document.createElement("script");
    script.src = "/static/plotly.min.js";
    script.addEventListener("load", () => resolve(window.Plotly));
    script.addEventListener("error", () => reject(new Error("plotly.js did not load (/static/plotly.min.js)")));
    document.head.append(script);
  });
  return plotly;
}

export { STUDY_STATES };
// Still changing: polled while the page is open (a cancelling study ends once its worker stopped its trials).
export const isLive = (status) => LIVE_STUDY.includes(status);
export const isCancellable = (status) => CANCELLABLE_STUDY.includes(status);
export const statusBadge = (status) => el("span", { class: `badge ${status}` }, status);
// A model as the listings name it: its key and its family ("llama3.1-8b (llama)", tuner/models.py).
export const modelLabel = (r) => (r.family ? `${r.model} (${r.family})` : r.model);
// The parallel axes (GET /api/axes, trainer/contract/axes.py) whose value differs between trials.
export const variedAxes = (axes, trials) => (axes || []).filter((a) => new Set(trials.map((t) => String(t[a.name]))).size > 1);
export const fact = (label, value, cls) => el("div", { class: cls }, el("dt", {}, label), el("dd", {}, value));
