"""The JavaScript that runs inside a MiniWoB++ page: the text rendering of the DOM and the ref lookup.

Rendering walks the visible DOM in document order (skipping MiniWoB's own HUD: the reward
display, the start cover, the click canvas and the utterance, which the observation states
separately). An element gets a line when it is something an agent can act on or read: a form
control, a link or button, an element with text of its own, or a visible leaf with an id or a
class (MiniWoB's icons, e.g. the email inbox's trash can, are empty styled spans). Elements
without any of these are dropped and their children lifted up a level, which keeps the tree
shallow. Each line is `[ref] tag#id.class "text" state...`, indented by depth; the state says
e.g. checked, value="...", selected, focused, expanded, and for an element that scrolls, where
it is scrolled to (scroll=top, 40%, bottom).

Refs are stored on the elements (`data-agref`) the first time they are rendered, counting up
from 1 on each page load, so an element keeps its ref for the whole episode and the same page
state always renders the same refs (the walk order is the document order).
"""

# Returns [utterance, lines]; lines is a list of [depth, text] pairs.
RENDER_JS = r"""
const SKIP_IDS = new Set(['reward-display', 'sync-task-cover', 'click-canvas', 'query']);
const ACTIONABLE = new Set(['A', 'BUTTON', 'INPUT', 'SELECT', 'TEXTAREA', 'OPTION', 'LABEL']);
const MAX_TEXT = arguments[0];
if (window.__agNext === undefined) window.__agNext = 1;
const clip = (s) => { s = s.replace(/\s+/g, ' ').trim(); return s.length > MAX_TEXT ? s.slice(0, MAX_TEXT) + '...' : s; };
const quote = (s) => JSON.stringify(s);
const refOf = (el) => {
  if (!el.dataset.agref) el.dataset.agref = String(window.__agNext++);
  return el.dataset.agref;
};
const shown = (el) => {
  const rect = el.getBoundingClientRect();
  if (rect.width === 0 || rect.height === 0) return false;
  const style = window.getComputedStyle(el);
  return style.visibility !== 'hidden' && style.display !== 'none';
};
// Class names that say something (jQuery UI's generic styling classes are noise; its widget parts,
// e.g. ui-spinner-up, are not).
const NOISE = /^ui-(widget|state|corner|helper|front|button|icon|priority|resizable|draggable|selectee|menu-item-wrapper|autocomplete-input|accordion-icons)/;
const classesOf = (el) => (typeof el.className === 'string' ? el.className.trim().split(/\s+/) : []).filter((c) => c && !NOISE.test(c));
const describe = (el, text) => {
  let head = el.tagName.toLowerCase();
  if (el.id) head += '#' + el.id;
  else head += classesOf(el).slice(0, 2).map((c) => '.' + c).join('');
  const parts = ['[' + refOf(el) + '] ' + head];
  if (text) parts.push(quote(clip(text)));
  if (el instanceof HTMLInputElement) {
    const type = el.type;
    if (type === 'checkbox' || type === 'radio') parts.push(type, el.checked ? 'checked' : 'unchecked');
    else {
      parts.push(type);
      parts.push('value=' + quote(type === 'password' ? el.value.replace(/./g, '*') : clip(el.value)));
      if (el.placeholder) parts.push('placeholder=' + quote(clip(el.placeholder)));
    }
  } else if (el instanceof HTMLTextAreaElement) {
    parts.push('value=' + quote(clip(el.value)));
  } else if (el instanceof HTMLSelectElement) {
    const option = el.options[el.selectedIndex];
    parts.push('selected=' + quote(option ? clip(option.text) : ''));
  } else if (el instanceof HTMLOptionElement && el.selected) {
    parts.push('selected');
  }
  if (el.disabled) parts.push('disabled');
  if (el !== document.body && el.scrollHeight > el.clientHeight + 1 && window.getComputedStyle(el).overflowY !== 'visible') {
    const room = el.scrollHeight - el.clientHeight;  // how far it scrolls
    parts.push('scroll=' + (el.scrollTop <= 1 ? 'top' : el.scrollTop >= room - 1 ? 'bottom' : Math.round(100 * el.scrollTop / room) + '%'));
  }
  const expanded = el.getAttribute('aria-expanded');
  if (expanded === 'true' || expanded === 'false') parts.push(expanded === 'true' ? 'expanded' : 'collapsed');
  if (typeof el.className === 'string' && /\bui-(state|tabs)-active\b/.test(el.className)) parts.push('active');
  if (document.activeElement === el && el !== document.body) parts.push('focused');
  return parts.join(' ');
};
const lines = [];
const walk = (el, depth, inSelect) => {
  if (SKIP_IDS.has(el.id) || el.tagName === 'SCRIPT' || el.tagName === 'STYLE') return;
  if (!inSelect && !shown(el)) return;  // a closed <select>'s options have no box, but count
  const kids = Array.from(el.childNodes).filter(
    (n) => (n.nodeType === Node.TEXT_NODE && n.data.trim()) || (n.nodeType === Node.ELEMENT_NODE && n.tagName !== 'BR'));
  const textOnly = kids.every((n) => n.nodeType === Node.TEXT_NODE);
  const ownText = textOnly && el.tagName !== 'TEXTAREA' ? el.textContent : '';  // a textarea shows its value
  const printed = ACTIONABLE.has(el.tagName) || ownText.trim() !== '' || el.hasAttribute('onclick') ||
      el.hasAttribute('tabindex') || (kids.length === 0 && (el.id || classesOf(el).length > 0));
  let childDepth = depth;
  if (printed && el !== document.body) {
    lines.push([depth, describe(el, ownText)]);
    childDepth = depth + 1;
  }
  if (textOnly || el.tagName === 'TEXTAREA') return;
  for (const n of kids) {
    if (n.nodeType === Node.TEXT_NODE) lines.push([childDepth, quote(clip(n.data))]);
    else walk(n, childDepth, inSelect || el.tagName === 'SELECT');
  }
};
walk(document.body, 0, false);
const query = document.getElementById('query');
return [query ? query.textContent.replace(/\s+/g, ' ').trim() : '', lines];
"""

# The element rendered as `[ref]`, or null when the page has none (or it is no longer shown).
FIND_JS = r"""
const el = document.querySelector('[data-agref="' + arguments[0] + '"]');
if (!el) return null;
const rect = el.getBoundingClientRect();
const inSelect = el.closest('select') !== null;
return (inSelect || (rect.width > 0 && rect.height > 0)) ? el : null;
"""

# (async) Waits until the page has loaded and its onload has shown MiniWoB's start cover (the
# state `core.startEpisodeReal` needs), then seeds MiniWoB's random generator, sets the episode
# time limit, starts the episode and waits for the images its elements show. An icon drawn from
# an image (an <img>, or CSS `content: url(...)` like the email inbox's star) has no size until
# its image loads, and the episode's elements only ask for theirs when they are created: without
# the wait a busy machine renders the first observation without them. The script's time-out
# bounds the wait; an image that fails to load is not waited for again.
START_JS = r"""
const [seed, limit, done] = arguments;
const ready = () => document.readyState === 'complete' && typeof core !== 'undefined' &&
    core.cover_div !== null && WOB_TASK_READY;
const imageUrls = () => {
  const urls = new Set();
  for (const el of document.querySelectorAll('*')) {
    if (el instanceof HTMLImageElement && el.src) urls.add(el.src);
    const style = window.getComputedStyle(el);
    for (const value of [style.content, style.backgroundImage]) {
      for (const m of value.matchAll(/url\("?([^")]*)"?\)/g)) urls.add(m[1]);
    }
  }
  return Array.from(urls);
};
const loaded = (url) => { const img = new Image(); img.src = url; return img.decode().catch(() => null); };
const start = () => {
  Math.seedrandom(seed);
  core.EPISODE_MAX_TIME = limit;
  core.startEpisodeReal();
  Promise.all(imageUrls().map(loaded)).then(() => done(true));
};
const wait = () => (ready() ? start() : setTimeout(wait, 10));
wait();
"""

# [done, raw reward (no time penalty), reason] of the current episode.
STATUS_JS = "return [WOB_DONE_GLOBAL, WOB_RAW_REWARD_GLOBAL, WOB_REWARD_REASON === null ? null : String(WOB_REWARD_REASON)];"
