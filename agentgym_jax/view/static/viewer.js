// The viewer page: filters and pages come from the JSON API (one page of episodes in the
// browser at a time), an episode is fetched when opened and replayed turn by turn, every token
// shown with its loss mask (trained or not) and its log-prob on hover. No build step, no CDN.
"use strict";

const PAGE = 50;
const LOW_LOGPROB = Math.log(0.1); // trained tokens the policy gave less than 10% are marked
const MAX_COMPARE = 200; // episodes of one task listed for comparison
const $ = (id) => document.getElementById(id);
let info = null; // /api/runs
let offset = 0;
let total = 0;

async function api(path, params) {
  const response = await fetch(path + "?" + new URLSearchParams(params));
  const body = await response.json();
  if (!response.ok) throw new Error(body.error || response.statusText);
  return body;
}

function node(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

function showError(error) {
  const box = $("error");
  box.hidden = !error;
  box.textContent = error ? String(error.message || error) : "";
}

function fillSelect(select, values, anyLabel) {
  const keep = select.value;
  select.innerHTML = "";
  if (anyLabel) select.append(node("option", { value: "" }, anyLabel));
  for (const [value, label] of values) select.append(node("option", { value: String(value) }, label));
  if ([...select.options].some((o) => o.value === keep)) select.value = keep;
}

function currentRun() {
  return info.runs[Number($("f-run").value || 0)];
}

function filterParams() {
  const params = {};
  for (const [k, v] of new FormData($("filters"))) if (String(v).trim() !== "") params[k] = String(v).trim();
  return params;
}

async function loadRuns() {
  info = await api("/api/runs", {});
  $("runs").innerHTML = "";
  for (const r of info.runs) {
    const notes = [];
    if (!r.decoded) notes.push(node("span", { class: "warn" }, ` no tokenizer (${r.tokenizer}): ids shown`));
    if (r.bad_lines) notes.push(node("span", { class: "warn", title: r.bad_line_examples.join("\n") }, ` ${r.bad_lines} unreadable lines skipped`));
    $("runs").append(node("span", { class: "run", title: `files: ${r.files.join(", ")}\ntokenizer: ${r.tokenizer}` },
      `[${r.run}] ${r.name}: ${r.episodes} episodes`, ...notes));
  }
  fillSelect($("f-run"), info.runs.map((r) => [r.run, `${r.run}: ${r.name}`]));
  fillSelect($("compare-run"), info.runs.map((r) => [r.run, `${r.run}: ${r.name}`]));
  if (info.runs.length > 1) $("compare-run").value = "1";
  fillSelect($("f-status"), info.statuses.map((s) => [s, s]), "any");
  fillSelect($("f-pattern"), info.patterns.map((p) => [p, p]), "any");
  fillEnvs();
}

function fillEnvs() {
  fillSelect($("f-env"), currentRun().envs.map((e) => [e, e]), "any");
}

let listRequest = 0; // answers to an older request than the latest are dropped

async function loadList() {
  const params = filterParams();
  const mine = ++listRequest;
  showError(null);
  try {
    const [page, counts] = await Promise.all([
      api("/api/episodes", { ...params, offset, limit: PAGE }),
      api("/api/patterns", params),
    ]);
    if (mine !== listRequest) return;
    renderList(page);
    $("episodes").dataset.query = new URLSearchParams({ ...params, offset }).toString(); // what the list shows
    renderPatterns(counts);
  } catch (e) {
    showError(e);
  }
}

function renderList(page) {
  total = page.total;
  const body = $("episodes").querySelector("tbody");
  body.innerHTML = "";
  const run = Number($("f-run").value || 0);
  for (const e of page.episodes) {
    const tags = e.patterns.map((p) => node("span", { class: "tag" }, p));
    const row = node("tr", { "data-id": e.id, onclick: () => openEpisode($("pane-a"), run, e.id, row) },
      node("td", {}, String(e.id)), node("td", {}, e.env), node("td", {}, String(e.task_id)),
      node("td", {}, String(e.sample_idx)), node("td", {}, String(e.attempt)), node("td", {}, String(e.step)),
      node("td", { class: `status-${e.status}` }, e.status), node("td", {}, e.reward.toFixed(3)),
      node("td", {}, String(e.turns)), node("td", {}, String(e.tokens)), node("td", {}, String(e.invalid_actions)),
      node("td", {}, ...tags));
    body.append(row);
  }
  const last = Math.min(offset + PAGE, total);
  $("page-info").textContent = total ? `${offset + 1}-${last} of ${total}` : "no episodes match";
  $("page-no").value = String(Math.floor(offset / PAGE) + 1);
  $("prev").disabled = offset === 0;
  $("next").disabled = last >= total;
}

function renderPatterns(counts) {
  const box = $("patterns");
  box.innerHTML = "";
  const names = Object.keys(counts.patterns);
  const head = node("tr", {}, node("th", {}, "step"), node("th", {}, "episodes"), node("th", {}, "success"),
    ...names.map((n) => node("th", {}, n)));
  const table = node("table", { id: "patterns-table" }, node("thead", {}, head));
  const body = node("tbody");
  counts.steps.forEach((step, i) => {
    const cells = names.map((name) => {
      const n = counts.patterns[name][i];
      const onclick = () => { $("f-step").value = String(step); $("f-pattern").value = name; offset = 0; loadList(); };
      return n ? node("td", { class: "count", title: `list step ${step}, ${name}`, onclick }, String(n))
        : node("td", { class: "zero" }, "0");
    });
    body.append(node("tr", {}, node("td", {}, String(step)), node("td", {}, String(counts.episodes[i])),
      node("td", {}, String(counts.success[i])), ...cells));
  });
  table.append(body);
  box.append(table);
  $("patterns-note").textContent = `(${counts.steps.length} steps)`;
}

// ---- one episode, replayed turn by turn ----

function flatTokens(ep) {
  const flat = { ids: [], text: [], mask: [], logprob: [] };
  for (const seg of [ep.prompt, ...ep.turns.flatMap((t) => [t.policy, t.observation])]) {
    flat.ids.push(...seg.ids);
    flat.mask.push(...seg.mask);
    flat.logprob.push(...seg.logprob);
    flat.text.push(...(seg.text || seg.ids.map(() => null)));
  }
  return flat;
}

function tokenSpans(seg) {
  const out = document.createDocumentFragment();
  seg.ids.forEach((id, k) => {
    const i = seg.start + k;
    const piece = seg.text ? seg.text[k] : null;
    let cls = `t m${seg.mask[k]}`;
    if (seg.mask[k] && seg.logprob[k] < LOW_LOGPROB) cls += " low";
    if (piece === null) cls += " id";
    else if (/^<\|.*\|>$|^<\/?s>$/.test(piece)) cls += " special";
    out.append(node("span", { class: cls, "data-i": String(i) }, piece === null ? `⟨${id}⟩` : piece));
  });
  return out;
}

function segment(kind, label, seg) {
  return node("div", { class: `seg ${kind}` }, node("div", { class: "role" }, label),
    node("div", { class: "toks" }, tokenSpans(seg)));
}

function renderTurns(pane) {
  const { ep, shown } = pane.state;
  const body = pane.querySelector(".ep-body");
  body.innerHTML = "";
  body.append(segment("prompt", "prompt", ep.prompt));
  ep.turns.slice(0, shown).forEach((turn, i) => {
    const marks = [];
    if (turn.repeat) marks.push("same action as the turn before");
    if (turn.truncated) marks.push("cut by the token limit (no end-of-turn sampled)");
    const reward = turn.reward === null ? "never sent" : `reward ${turn.reward}`;
    body.append(segment("policy", `turn ${i + 1}: policy, ${reward}${marks.length ? " | " + marks.join(", ") : ""}`, turn.policy));
    if (turn.observation.ids.length) body.append(segment("observation", `turn ${i + 1}: environment`, turn.observation));
  });
  if (shown === ep.turns.length) {
    body.append(node("div", { class: `seg end status-${ep.status}` },
      `episode ended: ${ep.status}, reward ${ep.reward}, ${ep.invalid_actions} invalid actions`));
  }
  if (ep.text !== null) body.append(node("div", { class: "role" }, "the record's own decoding:"), node("pre", { class: "text" }, ep.text));
  pane.querySelector(".turn-no").textContent = `turn ${shown} / ${ep.turns.length}`;
  pane.querySelector(".turn-range").value = String(shown);
}

function renderEpisode(pane, ep, runName) {
  pane.state = { ep, shown: ep.turns.length, flat: flatTokens(ep) };
  pane.innerHTML = "";
  const tags = ep.patterns.map((p) => node("span", { class: "tag" }, p));
  const step = (k) => () => { pane.state.shown = Math.max(0, Math.min(ep.turns.length, k(pane.state.shown))); renderTurns(pane); };
  const range = node("input", { type: "range", class: "turn-range", min: "0", max: String(ep.turns.length) });
  range.addEventListener("input", () => { pane.state.shown = Number(range.value); renderTurns(pane); });
  pane.append(
    node("div", { class: "ep-head" },
      node("b", {}, `${runName} #${ep.id}`), ` ${ep.env} task ${ep.task_id} sample ${ep.sample_idx} attempt ${ep.attempt} step ${ep.step} `,
      node("span", { class: `status-${ep.status}` }, ep.status), ` reward ${ep.reward} `, ...tags,
      node("div", { class: "where" }, ep.location)),
    node("div", { class: "legend" }, node("span", { class: "t m1" }, "trained (loss_mask 1)"),
      node("span", { class: "t m1 low" }, "trained, p < 0.1"), node("span", { class: "t m0" }, "not trained (loss_mask 0)")),
    node("div", { class: "replay" },
      node("button", { type: "button", class: "first", onclick: step(() => 0) }, "« start"),
      node("button", { type: "button", class: "prev-turn", onclick: step((s) => s - 1) }, "‹ turn"),
      range,
      node("button", { type: "button", class: "next-turn", onclick: step((s) => s + 1) }, "turn ›"),
      node("button", { type: "button", class: "all", onclick: step(() => Infinity) }, "all »"),
      node("span", { class: "turn-no" })),
    node("div", { class: "ep-body" }));
  renderTurns(pane);
}

async function openEpisode(pane, run, id, row) {
  const mine = pane.request = (pane.request || 0) + 1;
  showError(null);
  try {
    const ep = await api("/api/episode", { run, id });
    if (mine !== pane.request) return; // another episode was asked for meanwhile
    renderEpisode(pane, ep, info.runs[run].name);
    if (row) {
      for (const r of row.parentNode.children) r.classList.toggle("open", r === row);
      loadCompare(ep);
    }
  } catch (e) {
    showError(e);
  }
}

// ---- the same task in another run ----

let compareWith = null; // the episode open in pane A

async function loadCompare(ep) {
  compareWith = ep;
  const run = Number($("compare-run").value);
  $("compare-task").textContent = `${ep.env} task ${ep.task_id}`;
  const list = $("compare-list");
  try {
    const found = (await api("/api/task", { env: ep.env, task: ep.task_id })).runs[run].episodes;
    if (compareWith !== ep || run !== Number($("compare-run").value)) return; // asked again meanwhile
    list.innerHTML = "";
    if (!found.length) list.append(node("span", { class: "hint" }, " no episode of this task in that run"));
    for (const e of found.slice(0, MAX_COMPARE)) {
      list.append(node("button", { type: "button", "data-id": e.id, onclick: () => openEpisode($("pane-b-episode"), run, e.id) },
        `#${e.id} s${e.sample_idx} a${e.attempt} step ${e.step} ${e.status} ${e.reward.toFixed(2)}`));
    }
    const same = found.filter((e) => e.sample_idx === ep.sample_idx && !(run === ep.run && e.id === ep.id));
    const first = same.length ? same[same.length - 1] : found.find((e) => !(run === ep.run && e.id === ep.id));
    if (first) await openEpisode($("pane-b-episode"), run, first.id);
    else $("pane-b-episode").innerHTML = "";
  } catch (e) {
    showError(e);
  }
}

// ---- hover: one token's id, mask and log-prob ----

document.addEventListener("mouseover", (event) => {
  const span = event.target.closest ? event.target.closest(".t[data-i]") : null;
  const pane = span && span.closest(".pane-ep");
  if (!pane || !pane.state) return;
  const i = Number(span.dataset.i);
  const f = pane.state.flat;
  const trained = f.mask[i] ? "1 (trained)" : "0 (not trained)";
  const lp = f.logprob[i];
  let prob = "logprob - (not sampled by the policy)";
  if (f.mask[i]) prob = lp === null ? "logprob not finite" : `logprob ${lp.toFixed(4)} (p ${Math.exp(lp).toFixed(4)})`;
  $("tokinfo").textContent = `token ${i}  id ${f.ids[i]}  ${JSON.stringify(f.text[i] ?? null)}  loss_mask ${trained}  ${prob}`;
});

// ---- wiring ----

$("filters").addEventListener("submit", (event) => { event.preventDefault(); offset = 0; loadList(); });
$("f-run").addEventListener("change", () => { fillEnvs(); offset = 0; loadList(); });
$("f-clear").addEventListener("click", () => {
  for (const id of ["f-env", "f-status", "f-pattern", "f-step", "f-task", "f-reward-min", "f-reward-max"]) $(id).value = "";
  offset = 0;
  loadList();
});
$("prev").addEventListener("click", () => { offset = Math.max(0, offset - PAGE); loadList(); });
$("next").addEventListener("click", () => { if (offset + PAGE < total) { offset += PAGE; loadList(); } });
$("page-no").addEventListener("change", () => {
  const page = Math.max(1, Math.min(Math.ceil(total / PAGE), Number($("page-no").value) || 1));
  offset = (page - 1) * PAGE;
  loadList();
});
$("compare-run").addEventListener("change", () => { if (compareWith) loadCompare(compareWith); });
$("pane-a").classList.add("pane-ep");
$("pane-b-episode").classList.add("pane-ep");

loadRuns().then(loadList).catch(showError);
