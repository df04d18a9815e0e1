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
    if (!r.decoded) notes.push(node("span", { class: "warn", title: r.tokenizer }, " no tokenizer: ids shown"));
    if (r.bad_lines) notes.push(node("span", { class: "warn", title: r.bad_line_examples.join("\n") }, ` ${r.bad_lines} unreadable lines skipped`));
    $("runs").append(node("span", { class: "run", title: `files: ${r.files.join(", ")}\ntokenizer: ${r.tokenizer}` },
      `[${r.run}] ${r.name}: ${r.episodes} episodes`, ...notes));
  }
  fillSelect($("f-run"), info.runs.map((r) => [r.run, `${r.run}: ${r.name}`]));
  fillSelect($("compare-run"), info.runs.map((r) => [r.run, `${r.run}: ${r.name}`]));
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
    if (mine !== listRequest) return;
    renderList({ total: 0, episodes: [] }, "no episodes listed: the filter cannot be read");  // nothing stale under the error
    renderPatterns({ steps: [], episodes: [], success: [], patterns: {} });
    $("episodes").dataset.query = "";
    showError(e);
  }
}

const stepText = (step) => (step > 0 ? String(step) : "–"); // 0: no update trained on it (docs/viewer.md)

function wrappable(text) { // breaks allowed after underscores: long statuses and pattern names fit narrow columns
  const out = document.createDocumentFragment();
  text.split("_").forEach((part, i, parts) => {
    out.append(part + (i < parts.length - 1 ? "_" : ""));
    if (i < parts.length - 1) out.append(node("wbr"));
  });
  return out;
}

function renderList(page, empty = "no episodes match") {
  total = page.total;
  const body = $("episodes").querySelector("tbody");
  body.innerHTML = "";
  const run = Number($("f-run").value || 0);
  for (const e of page.episodes) {
    const tags = e.patterns.map((p) => node("span", { class: "tag" }, wrappable(p)));
    const row = node("tr", { "data-id": e.id, onclick: () => openEpisode($("pane-a"), run, e.id, row) },
      node("td", {}, String(e.id)), node("td", {}, e.env), node("td", {}, String(e.task_id)),
      node("td", {}, String(e.sample_idx)), node("td", {}, String(e.attempt)), node("td", {}, stepText(e.step)),
      node("td", { class: `wraps status-${e.status}` }, wrappable(e.status)), node("td", {}, e.reward.toFixed(3)),
      node("td", {}, String(e.turns)), node("td", {}, String(e.tokens)), node("td", {}, String(e.invalid_actions)),
      node("td", { class: "wraps" }, ...tags));
    row.classList.toggle("open", openInList.run === run && openInList.id === e.id);
    body.append(row);
  }
  const last = Math.min(offset + PAGE, total);
  $("page-info").textContent = total ? `${offset + 1}-${last} of ${total}` : empty;
  $("page-no").value = String(Math.floor(offset / PAGE) + 1);
  $("prev").disabled = offset === 0;
  $("next").disabled = last >= total;
}

function renderPatterns(counts) {
  const box = $("patterns");
  box.innerHTML = "";
  const names = Object.keys(counts.patterns);
  const head = node("tr", {}, node("th", {}, "step"), node("th", {}, "episodes"), node("th", {}, "success"),
    ...names.map((n) => node("th", {}, wrappable(n))));
  const table = node("table", { id: "patterns-table" }, node("thead", {}, head));
  const body = node("tbody");
  counts.steps.forEach((step, i) => {
    const cells = names.map((name) => {
      const n = counts.patterns[name][i];
      const onclick = () => { $("f-step").value = String(step); $("f-pattern").value = name; offset = 0; loadList(); };
      return n ? node("td", { class: "count", title: `list step ${step}, ${name}`, onclick }, String(n))
        : node("td", { class: "zero" }, "0");
    });
    body.append(node("tr", {}, node("td", {}, stepText(step)), node("td", {}, String(counts.episodes[i])),
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
  let leading = true; // the segment's box starts a line: its first newlines are not shown as blank lines
  seg.ids.forEach((id, k) => {
    const i = seg.start + k;
    const piece = seg.text ? seg.text[k] : null;
    let cls = `t m${seg.mask[k]}`;
    if (seg.mask[k] && seg.logprob[k] < LOW_LOGPROB) cls += " low";
    if (piece === null) cls += " id";
    else if (/^<\|.*\|>$|^<\/?s>$/.test(piece)) cls += " special";
    const text = piece === null ? [`⟨${id}⟩`] : [piece];
    if (leading && piece !== null) {
      const newlines = piece.match(/^\n*/)[0];
      if (newlines) text.splice(0, 1, node("span", { class: "lead-nl" }, newlines), piece.slice(newlines.length));
      leading = piece.length === newlines.length;
    } else leading = false;
    out.append(node("span", { class: cls, "data-i": String(i) }, ...text));
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

function legend(ep) {
  // loss_mask 1 marks the policy's sampled tokens; they were trained on only where an RL step used the episode
  if (ep.step > 0) {
    return [node("span", { class: "t m1" }, `trained in step ${ep.step} (loss_mask 1)`),
      node("span", { class: "t m1 low" }, "trained, p < 0.1"), node("span", { class: "t m0" }, "not trained (loss_mask 0)")];
  }
  return [node("span", { class: "t m1" }, "sampled by the policy (loss_mask 1)"),
    node("span", { class: "t m1 low" }, "sampled, p < 0.1"), node("span", { class: "t m0" }, "prompt, template, environment (loss_mask 0)"),
    node("span", { class: "hint" }, "no update trained on this episode")];
}

function renderEpisode(pane, ep, runName) {
  pane.state = { ep, shown: ep.turns.length, flat: flatTokens(ep) };
  pane.innerHTML = "";
  const tags = ep.patterns.map((p) => node("span", { class: "tag" }, p));
  const step = (k) => () => { pane.state.shown = Math.max(0, Math.min(ep.turns.length, k(pane.state.shown))); renderTurns(pane); };
  const range = node("input", { type: "range", class: "turn-range", min: "0", max: String(ep.turns.length) });
  range.addEventListener("input", () => { pane.state.shown = Number(range.value); renderTurns(pane); });
  const trainedIn = ep.step > 0 ? `step ${ep.step}` : "step – (not trained on)";
  pane.append(
    node("div", { class: "ep-head" },
      node("b", {}, `${runName} #${ep.id}`), ` ${ep.env} task ${ep.task_id} sample ${ep.sample_idx} attempt ${ep.attempt} ${trainedIn} `,
      node("span", { class: `status-${ep.status}` }, ep.status), ` reward ${ep.reward} `, ...tags,
      node("div", { class: "where" }, ep.location)),
    node("div", { class: "legend" }, ...legend(ep)),
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

let openInList = { run: -1, id: -1 }; // the episode open in pane A

async function openEpisode(pane, run, id, row) {
  const mine = pane.request = (pane.request || 0) + 1;
  showError(null);
  try {
    const ep = await api("/api/episode", { run, id });
    if (mine !== pane.request) return; // another episode was asked for meanwhile
    renderEpisode(pane, ep, info.runs[run].name);
    if (row) {
      openInList = { run, id };
      for (const r of row.parentNode.children) r.classList.toggle("open", r === row);
      loadCompare(ep);
    } else markCompared();
  } catch (e) {
    showError(e);
  }
}

// ---- the same task in another run ----

let compareWith = null; // the episode open in pane A
let compareChosen = null; // the run picked in the compare pane by hand, if any
let compareFound = []; // per run: the other episodes of compareWith's task

function compareDefault(ep) {
  // the run picked by hand if it has the task, else the first other run that has it, else this run
  const has = (r) => compareFound[r].length > 0;
  if (compareChosen !== null && has(compareChosen)) return compareChosen;
  const others = info.runs.map((r) => r.run).filter((r) => r !== ep.run && has(r));
  return others.length ? others[0] : has(ep.run) ? ep.run : null;
}

function markCompared() {
  // the episode shown beside, and the one open on the left, marked in the compare list
  const shown = $("pane-b-episode").state;
  for (const button of $("compare-list").querySelectorAll("button")) {
    const run = Number(button.dataset.run), id = Number(button.dataset.id);
    const isShown = !!shown && shown.ep.run === run && shown.ep.id === id;
    button.classList.toggle("shown", isShown);
    button.setAttribute("aria-pressed", String(isShown));
  }
}

async function loadCompare(ep, picked = null) {
  compareWith = ep;
  const list = $("compare-list");
  const paneB = $("pane-b");
  try {
    const task = await api("/api/task", { env: ep.env, task: ep.task_id });
    if (compareWith !== ep) return; // another episode was opened meanwhile
    compareFound = task.runs.map((r) => r.episodes.filter((e) => !(r.run === ep.run && e.id === ep.id)));
    fillSelect($("compare-run"), info.runs.map((r) => [r.run, `${r.run}: ${r.name} (${compareFound[r.run].length})`]));
    const run = picked !== null ? picked : compareDefault(ep);
    $("compare-task").textContent = `${ep.env} task ${ep.task_id}`;
    list.innerHTML = "";
    $("pane-b-episode").innerHTML = "";
    $("pane-b-episode").state = null;
    if (run === null) {
      paneB.classList.add("empty");
      list.append(node("p", { class: "hint" }, "no other episode of this task in any run"));
      return;
    }
    $("compare-run").value = String(run);
    const found = compareFound[run];
    if (!found.length) {
      const elsewhere = info.runs.filter((r) => compareFound[r.run].length).map((r) => `${r.run}: ${r.name}`);
      paneB.classList.add("empty");
      list.append(node("p", { class: "hint" }, `no other episode of this task in ${info.runs[run].name}` +
        (elsewhere.length ? `; runs that have one: ${elsewhere.join(", ")}` : "; no run has one")));
      return;
    }
    paneB.classList.remove("empty");
    for (const e of found.slice(0, MAX_COMPARE)) {
      list.append(node("button", {
        type: "button", "data-run": String(run), "data-id": String(e.id), onclick: () => openEpisode($("pane-b-episode"), run, e.id),
      }, `#${e.id} s${e.sample_idx} a${e.attempt} step ${stepText(e.step)} ${e.status} ${e.reward.toFixed(2)}`));
    }
    const same = found.filter((e) => e.sample_idx === ep.sample_idx);
    await openEpisode($("pane-b-episode"), run, (same.length ? same[same.length - 1] : found[0]).id);
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
  const trained = pane.state.ep.step > 0 ? (f.mask[i] ? "1 (trained)" : "0 (not trained)")
    : (f.mask[i] ? "1 (sampled by the policy)" : "0 (not sampled)");
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
$("compare-run").addEventListener("change", () => {
  compareChosen = Number($("compare-run").value);
  if (compareWith) loadCompare(compareWith, compareChosen);
});
$("pane-a").classList.add("pane-ep");
$("pane-b-episode").classList.add("pane-ep");

loadRuns().then(loadList).catch(showError);
