"""The live status page the master serves at /ui: one self-contained HTML document (its script,
style and SVG inline; nothing fetched from elsewhere, since clusters are often air-gapped). It
holds no job data: its script reads the read-only token from the address's fragment (#token=...,
which a browser never sends to a server) and asks the read-only routes with it, every two seconds."""

import base64
import hashlib
import json

from elastic_step.protocol import SHOWN_EVENTS

STYLE = r"""  body { font: 14px/1.4 system-ui, sans-serif; margin: 0; color: #1d2330; background: #f5f6f8; }
  header { background: #1d2330; color: #fff; padding: 12px 20px; display: flex; gap: 24px; align-items: baseline; flex-wrap: wrap; }
  header h1 { font-size: 18px; margin: 0; }
  .state { font-weight: 600; padding: 2px 8px; border-radius: 4px; background: #44506a; }
  .state.running { background: #2f7d32; } .state.failed { background: #b3261e; }
  .state.succeeded { background: #1565c0; } .state.stopped, .state.preempted { background: #8a6d00; }
  main { padding: 16px 20px; display: grid; grid-template-columns: repeat(auto-fit, minmax(420px, 1fr)); gap: 16px; }
  section { background: #fff; border-radius: 6px; padding: 12px 16px; box-shadow: 0 1px 2px rgba(0,0,0,.08); }
  section.wide { grid-column: 1 / -1; }
  h2 { font-size: 15px; margin: 0 0 8px; }
  .figures { display: flex; gap: 20px; flex-wrap: wrap; }
  .figure b { display: block; font-size: 20px; }
  .bar { height: 14px; background: #e3e6ec; border-radius: 7px; overflow: hidden; margin: 8px 0 4px; }
  .bar div { height: 100%; background: #2f7d32; width: 0; }
  svg { width: 100%; height: 160px; display: block; }
  svg.timeline { height: auto; }
  .axis { stroke: #9aa3b5; stroke-width: 1; } .tick { fill: #5b6478; font-size: 11px; }
  table { border-collapse: collapse; width: 100%; } td, th { text-align: left; padding: 3px 8px 3px 0; font-size: 13px; }
  th { color: #5b6478; font-weight: 600; }
  #message { padding: 10px 20px; background: #fff3cd; display: none; }
  #message.shown { display: block; }
  .muted { color: #5b6478; }
"""

SCRIPT = r""""use strict";
const API = "/v1";
const REFRESH_MS = 2000;
const SHOWN = {SHOWN_EVENTS};
const token = new URLSearchParams(location.hash.slice(1)).get("token");
const events = [];
let nextEvent = 0;

function text(id, value) { document.getElementById(id).textContent = value; }
function say(message) {
  const box = document.getElementById("message");
  box.textContent = message || "";
  box.className = message ? "shown" : "";
}
function svgElement(name, attrs, content) {
  const el = document.createElementNS("http://www.w3.org/2000/svg", name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (content !== undefined) el.textContent = content;
  return el;
}
function fmt(v, digits) { return v === null || v === undefined || Number.isNaN(v) ? "-" : Number(v).toFixed(digits); }
function auto(v) { const a = Math.abs(v); return fmt(v, a >= 100 ? 0 : a >= 1 ? 2 : 3); }
function clock(t) { return new Date(t * 1000).toLocaleTimeString(); }

async function ask(path) {
  const reply = await fetch(API + path, {headers: {"Authorization": "Bearer " + token}, cache: "no-store"});
  if (reply.status === 401) throw new Error("token");
  if (!reply.ok) throw new Error("status " + reply.status);
  return reply.json();
}

function lineChart(id, points, key, color, step) {
  const svg = document.getElementById(id);
  svg.replaceChildren();
  const W = 600, H = 160, L = 44, B = 18;
  const data = points.filter(p => p[key] !== null && p[key] !== undefined && Number.isFinite(p[key]));
  svg.appendChild(svgElement("line", {x1: L, y1: H - B, x2: W, y2: H - B, class: "axis"}));
  svg.appendChild(svgElement("line", {x1: L, y1: 0, x2: L, y2: H - B, class: "axis"}));
  if (data.length === 0) { svg.appendChild(svgElement("text", {x: L + 8, y: 20, class: "tick"}, "no steps yet")); return; }
  const t0 = data[0].time, t1 = Math.max(data[data.length - 1].time, t0 + 1e-6);
  let lo = Math.min(...data.map(p => p[key])), hi = Math.max(...data.map(p => p[key]));
  if (step) { lo = 0; hi = hi + 1; }  // whole numbers from 0, the line below the top
  if (hi - lo < 1e-9) { hi = lo + 1; }
  const x = t => L + (W - L - 4) * (t - t0) / (t1 - t0);
  const y = v => 4 + (H - B - 8) * (1 - (v - lo) / (hi - lo));
  let d = "";
  data.forEach((p, i) => {
    if (step && i > 0) d += ` L${x(p.time).toFixed(1)},${y(data[i - 1][key]).toFixed(1)}`;
    d += `${i ? " L" : "M"}${x(p.time).toFixed(1)},${y(p[key]).toFixed(1)}`;
  });
  svg.appendChild(svgElement("path", {d, fill: "none", stroke: color, "stroke-width": 1.5, "vector-effect": "non-scaling-stroke", class: "series"}));
  svg.appendChild(svgElement("text", {x: 2, y: 12, class: "tick"}, step ? fmt(hi, 0) : auto(hi)));
  svg.appendChild(svgElement("text", {x: 2, y: H - B, class: "tick"}, step ? fmt(lo, 0) : auto(lo)));
  svg.appendChild(svgElement("text", {x: W - 4, y: H - 4, class: "tick", "text-anchor": "end"}, `${(t1 - t0).toFixed(0)} s`));
}

function smooth(points) {
  // samples/s of one step is noisy: a moving mean over the last 10 points
  return points.map((p, i) => {
    const window = points.slice(Math.max(0, i - 9), i + 1).map(q => q.samples_per_s).filter(v => v !== null);
    return {time: p.time, samples_per_s: window.length ? window.reduce((a, b) => a + b, 0) / window.length : null};
  });
}

const COLORS = {live: "#2f7d32", spare: "#3a6fb0", launched: "#9aa3b5", retiring: "#8a6d00", gone: "#b3261e"};
function shownState(w) {
  // a spare is live but holds no rank: it waits, warmed up, to take a member's place
  return w.spare && w.state === "live" ? "spare" : w.state;
}
function timeline(status, now) {
  const svg = document.getElementById("timeline");
  svg.replaceChildren();
  const workers = status.workers || [];
  const slots = [...new Set(workers.map(w => w.slot))].sort((a, b) => a - b);
  const t0 = Math.min(status.started_at || now, ...workers.map(w => w.launched_at || now));
  const t1 = Math.max(now, t0 + 1);
  const L = 60, W = 1000, ROW = 34;
  svg.setAttribute("viewBox", `0 0 ${W} ${slots.length * ROW + 20}`);
  const x = t => L + (W - L - 10) * (t - t0) / (t1 - t0);
  slots.forEach((slot, row) => {
    const top = row * ROW + 4;
    svg.appendChild(svgElement("text", {x: 4, y: top + 18, class: "tick"}, `slot ${slot}`));
    workers.filter(w => w.slot === slot).forEach(w => {
      const start = x(w.launched_at || t0), end = x(w.exited_at || (w.state === "gone" ? w.last_seen || now : now));
      const g = svgElement("g", {class: "attempt", "data-worker": w.id});
      g.appendChild(svgElement("rect", {x: start, y: top, width: Math.max(end - start, 2), height: 24, rx: 3,
                                        fill: COLORS[shownState(w)] || "#9aa3b5", opacity: w.state === "gone" ? 0.75 : 1}));
      const label = w.id + (w.state === "gone" ? " \u2014 " + (w.exit || "exited") : w.rank !== null && w.rank !== undefined ? ` rank ${w.rank}` : ` ${shownState(w)}`);
      g.appendChild(svgElement("text", {x: start + 4, y: top + 16, fill: "#fff", "font-size": 12}, label));
      g.appendChild(svgElement("title", {}, label));
      svg.appendChild(g);
    });
  });
  svg.appendChild(svgElement("text", {x: W - 10, y: slots.length * ROW + 16, class: "tick", "text-anchor": "end"},
                             `${(t1 - t0).toFixed(0)} s since the job started`));
}

function describe(e) {
  if (e.event === "regrouped") return `round ${e.round}: ${e.world_size} workers (${(e.members || []).join(", ")}) from step ${e.start_step}`;
  if (e.event === "recovered") return `round ${e.round} trained again ${fmt(e.seconds, 2)} s after: ${e.cause || ""}`;
  if (e.event === "checkpoint") return `step ${e.step}`;
  const rest = Object.entries(e).filter(([k]) => !["time", "event", "message", "members"].includes(k)).map(([k, v]) => `${k}=${v}`);
  return (rest.join(" ") + " " + (e.message || "")).trim();
}

function rows(tableId, items, cells) {
  const body = document.querySelector(`#${tableId} tbody`);
  body.replaceChildren(...items.map(item => {
    const tr = document.createElement("tr");
    for (const c of cells(item)) { const td = document.createElement("td"); td.textContent = c; tr.appendChild(td); }
    return tr;
  }));
}

function show(status, history) {
  const now = Date.now() / 1000;
  document.title = `${status.job}: ${status.state}`;
  text("job", status.job);
  const state = document.getElementById("state");
  state.textContent = status.state + (status.stopping ? " (stopping)" : "");
  state.className = "state " + status.state;
  text("epoch", `${status.epoch + 1} / ${status.epochs}`);
  text("rows", `${status.rows_done} / ${status.rows_total}`);
  text("step", status.step);
  text("loss", fmt(status.loss, 4));
  text("sps", fmt(status.samples_per_s, 0));
  text("world", `${status.world_size} / ${status.target_workers}` + (status.spares ? ` + ${status.spares} spare${status.spares > 1 ? "s" : ""}` : ""));
  text("round", status.round);
  const done = status.epochs ? (status.epoch + (status.rows_total ? status.rows_done / status.rows_total : 0)) / status.epochs : 0;
  document.getElementById("progress").style.width = `${Math.min(100, 100 * (status.state === "succeeded" ? 1 : done)).toFixed(1)}%`;
  text("failure", status.failure || "");
  lineChart("loss-chart", history, "loss", "#1565c0");
  lineChart("sps-chart", smooth(history), "samples_per_s", "#2f7d32");
  lineChart("world-chart", history, "world_size", "#8a3ffc", true);
  timeline(status, now);
  rows("recoveries", events.filter(e => e.event === "recovered"), e => [e.round, fmt(e.seconds, 2), e.cause || ""]);
  rows("events", events.filter(e => SHOWN.includes(e.event)).slice(-200).reverse(), e => [clock(e.time), e.event, describe(e)]);
  text("updated", "updated " + new Date().toLocaleTimeString());
}

async function refresh() {
  try {
    const [status, page, history] = await Promise.all([ask("/status"), ask(`/events?since=${nextEvent}`), ask("/history")]);
    events.push(...page.events);
    nextEvent = page.next;
    show(status, history.steps);
    say("");
    if (status.state === "running") setTimeout(refresh, REFRESH_MS);
  } catch (err) {
    if (err.message === "token") {
      say("The token in this page's address is not this job's. Open the address `elastic-step get JOB` prints.");
      return;
    }
    say("The job's master does not answer: the job has ended or its master is gone. What is shown is its last state.");
    setTimeout(refresh, REFRESH_MS * 2);
  }
}

if (!token) {
  say("This page needs the job's read-only token. Open the address `elastic-step get JOB` prints (it ends in #token=...).");
  text("state", "no token");
} else {
  refresh();
}
"""
# The event kinds the page lists, from the one place every view takes them (before the script's hash).
SCRIPT = SCRIPT.replace("{SHOWN_EVENTS}", json.dumps([str(kind) for kind in SHOWN_EVENTS]))

_DOCUMENT = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>elastic-step job</title>
<style>
{STYLE}</style>
</head>
<body>
<header>
  <h1 id="job">elastic-step job</h1>
  <span id="state" class="state">loading</span>
  <span id="updated" class="muted"></span>
</header>
<div id="message" role="alert"></div>
<main>
  <section class="wide" aria-label="progress">
    <h2>Progress</h2>
    <div class="figures">
      <div class="figure">epoch<b id="epoch">-</b></div>
      <div class="figure">rows<b id="rows">-</b></div>
      <div class="figure">step<b id="step">-</b></div>
      <div class="figure">loss<b id="loss">-</b></div>
      <div class="figure">samples/s<b id="sps">-</b></div>
      <div class="figure">workers<b id="world">-</b></div>
      <div class="figure">round<b id="round">-</b></div>
    </div>
    <div class="bar"><div id="progress"></div></div>
    <div id="failure" class="muted"></div>
  </section>
  <section aria-label="loss"><h2>Loss</h2><svg id="loss-chart" viewBox="0 0 600 160" preserveAspectRatio="none"></svg></section>
  <section aria-label="samples per second"><h2>Samples/s</h2><svg id="sps-chart" viewBox="0 0 600 160" preserveAspectRatio="none"></svg></section>
  <section aria-label="world size"><h2>World size</h2><svg id="world-chart" viewBox="0 0 600 160" preserveAspectRatio="none"></svg></section>
  <section aria-label="recoveries"><h2>Recoveries</h2><table id="recoveries"><thead><tr><th>round</th><th>seconds</th><th>cause</th></tr></thead><tbody></tbody></table></section>
  <section class="wide" aria-label="workers"><h2>Workers: each slot's attempts</h2><svg id="timeline" class="timeline" viewBox="0 0 1000 40"></svg></section>
  <section class="wide" aria-label="events"><h2>Membership events</h2><table id="events"><thead><tr><th>time</th><th>event</th><th>detail</th></tr></thead><tbody></tbody></table></section>
</main>
<script>
{SCRIPT}</script>
</body>
</html>
"""


def _source_hash(text: str) -> str:
    """A CSP source that allows exactly the inline element holding `text`."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


PAGE = _DOCUMENT.replace("{STYLE}", STYLE).replace("{SCRIPT}", SCRIPT)

# What every answer carrying the page says: it holds no data; no other origin may frame it; only
# its own script and style run, allowed by their hashes (no 'unsafe-inline': markup injected into
# the page would not run, and no 'unsafe-eval'); it may call only the server it came from.
PAGE_HEADERS = {
    "Content-Security-Policy": f"default-src 'none'; script-src {_source_hash(chr(10) + SCRIPT)}; "
                               f"style-src {_source_hash(chr(10) + STYLE)}; "
                               "connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer", "Cache-Control": "no-store",
}
