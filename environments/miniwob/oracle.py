"""Scripted MiniWoB++ solvers: the next action from the utterance and the live page.

A solver reads the task's utterance (what a policy sees) and may read the page's DOM directly,
hidden parts included (it is an oracle), and answers one action in the observation's terms:
the refs of elements the current observation shows. Solvers hold no state between calls, so
`/oracle_action` works from any page state the solver knows (e.g. after a wrong click the
checkbox solver still fixes the boxes). Tasks without a solver are listed by `/tasks` as not
in `oracle_tasks`.
"""

from __future__ import annotations

import re
from typing import Any, Callable

from environments.miniwob.browser import Browser

# The ref of the first element matching a CSS selector (and, if given, whose whitespace-normalised
# text equals arguments[1]) that the observation shows; failing that, the first shown descendant
# of it with a ref (e.g. a button's label). null when there is none.
_REF_JS = r"""
const norm = (s) => s.replace(/\s+/g, ' ').trim();
const shown = (el) => { const r = el.getBoundingClientRect(); return el.dataset.agref && (r.width > 0 && r.height > 0 || el.closest('select')); };
const matches = Array.from(document.querySelectorAll(arguments[0])).filter((el) => arguments[1] === null || norm(el.textContent) === arguments[1]);
for (const el of matches) {
  if (shown(el)) return el.dataset.agref;
  const inner = Array.from(el.querySelectorAll('[data-agref]')).find(shown);
  if (inner) return inner.dataset.agref;
}
return null;
"""


class OracleError(RuntimeError):
    """The solver does not recognise the page (a bug, or a state it does not handle)."""


class Page:
    """What a solver may read: the utterance and the DOM of one browser."""

    def __init__(self, browser: Browser):
        self.browser = browser
        self.utterance = self.js("return document.getElementById('query').textContent.replace(/\\s+/g, ' ').trim();")

    def js(self, source: str, *args: Any) -> Any:
        return self.browser.script(source, *args)

    def ref(self, css: str, text: str | None = None) -> str | None:
        return self.js(_REF_JS, css, text)

    def need(self, css: str, text: str | None = None) -> str:
        ref = self.ref(css, text)
        if ref is None:
            raise OracleError(f"no shown element {css!r}" + (f" with text {text!r}" if text else "") + f" for {self.utterance!r}")
        return ref

    def value(self, css: str) -> str:
        return self.js("const el = document.querySelector(arguments[0]); return el ? el.value : null;", css)

    def match(self, pattern: str) -> re.Match:
        m = re.fullmatch(pattern, self.utterance)
        if m is None:
            raise OracleError(f"utterance {self.utterance!r} does not match {pattern!r}")
        return m


def click(ref: str) -> str:
    return f"click [{ref}]"


def type_into(ref: str, text: str) -> str:
    return f'type [{ref}] "{text}"'


def fill_then_click(page: Page, fields: list[tuple[str, str]], button: str, button_text: str | None = None) -> str:
    """Types each (css, text) field that does not hold its text yet, then clicks the button."""
    for css, text in fields:
        if page.value(css) != text:
            return type_into(page.need(css), text)
    return click(page.need(button, button_text))


def click_button(page: Page) -> str:
    return click(page.need("button", page.match(r'Click on the "(.*)" button\.')[1]))


def click_link(page: Page) -> str:
    return click(page.need("span.alink", page.match(r'Click on the link "(.*)"\.')[1]))


def enter_text(page: Page) -> str:
    return fill_then_click(page, [("#tt", page.match(r'Enter "(.*)" into the text field and press Submit\.')[1])], "#subbtn")


def enter_text_2(page: Page) -> str:
    m = page.match(r'Type "(.*)" in all (lower|upper) case letters in the text input and press Submit\.')
    text = m[1].lower() if m[2] == "lower" else m[1].upper()
    return fill_then_click(page, [("#tt", text)], "#subbtn")


def login_user(page: Page) -> str:
    m = page.match(r'Enter the username "(.*)" and the password "(.*)" into the text fields and press login\.')
    return fill_then_click(page, [("#username", m[1]), ("#password", m[2])], "#subbtn")


def enter_password(page: Page) -> str:
    m = page.match(r'Enter the password "(.*)" into both text fields and press submit\.')
    return fill_then_click(page, [("#password", m[1]), ("#verify", m[1])], "#subbtn")


def _boxes(page: Page) -> list[tuple[str, bool, str | None]]:
    """(label text, checked, ref of the input) of each checkbox or radio button in #boxes."""
    return page.js("""return Array.from(document.querySelectorAll('#boxes label')).map((l) => {
        const input = l.querySelector('input');
        return [l.textContent.trim(), input.checked, input.dataset.agref || null]; });""")


def click_checkboxes(page: Page) -> str:
    names = page.match(r"Select (.*) and click Submit\.")[1]
    wanted = set() if names == "nothing" else set(names.split(", "))
    for label, checked, ref in _boxes(page):
        if checked != (label in wanted):
            return click(ref)
    return click(page.need("#subbtn"))


def click_option(page: Page) -> str:
    name = page.match(r"Select (.*) and click Submit\.")[1]
    for label, checked, ref in _boxes(page):
        if label == name and not checked:
            return click(ref)
    return click(page.need("#subbtn"))


def choose_list(page: Page) -> str:
    name = page.match(r"Select (.*) from the list and click Submit\.")[1]
    selected = page.js("const s = document.getElementById('options'); return s.options[s.selectedIndex].textContent;")
    if selected != name:
        return click(page.need("#options option", name))
    return click(page.need("button", "Submit"))


def navigate_tree(page: Page) -> str:
    """Clicks the first item with the name once it shows; before that, the expander of its outermost collapsed folder."""
    name = page.match(r'Navigate through the file tree\. Find and click on the folder or file named "(.*)"\.')[1]
    ref = page.js("""
        const target = Array.from(document.querySelectorAll('#tree span')).find((s) => s.textContent === arguments[0]);
        if (!target) return null;
        const collapsed = [];
        for (let li = target.parentElement.parentElement.closest('li'); li; li = li.parentElement.closest('li'))
          if (li.classList.contains('expandable')) collapsed.push(li);
        const el = collapsed.length ? collapsed[collapsed.length - 1].querySelector(':scope > div.hitarea') : target;
        return el.dataset.agref || null;""", name)
    if ref is None:
        raise OracleError(f"navigate-tree: {name!r} or its folder is not shown")
    return click(ref)


def click_tab(page: Page) -> str:
    tab = page.match(r"Click on Tab #(\d)\.")[1]
    return click(page.need("#area ul a", f"Tab #{tab}"))


def click_tab_2(page: Page) -> str:
    """Clicks the link when its tab is open, else the tab that holds it; with no such link anywhere
    (click-tab-2-medium empties its second tab), clicking the second tab is the answer."""
    text = page.match(r'Switch between the tabs to find and click on the link "(.*)"\.')[1]
    ref = page.ref("#area span.alink", text)
    if ref is not None:
        return click(ref)
    panel = page.js("""const norm = (s) => s.replace(/\\s+/g, ' ').trim();
        const link = Array.from(document.querySelectorAll('#area span.alink')).find((s) => norm(s.textContent) === arguments[0]);
        return link ? link.closest('[role=tabpanel]').id : null;""", text)
    if panel is None:
        return click(page.need("#area li.ui-tab:nth-child(2)"))
    return click(page.need(f'#area ul a[href="#{panel}"]'))


def click_collapsible(page: Page) -> str:
    expanded = page.js("const c = document.querySelector('#area h3'); return c.getAttribute('aria-expanded') === 'true';")
    return click(page.need("#subbtn") if expanded else page.need("#area h3"))


def click_dialog(page: Page) -> str:
    page.match(r'Close the dialog box by clicking the "x"\.')
    return click(page.need("button.ui-dialog-titlebar-close"))


def click_dialog_2(page: Page) -> str:
    label = page.match(r'Click the button in the dialog box labeled "(.*)"\.')[1]
    if label == "x":
        return click(page.need("button.ui-dialog-titlebar-close"))
    return click(page.need(".ui-dialog button", label))


def click_test(page: Page) -> str:
    return click(page.need("button"))


def click_test_2(page: Page) -> str:
    return click(page.need("button", page.match(r"Click button (ONE|TWO)\.")[1]))


def click_button_sequence(page: Page) -> str:
    pushed = page.js("return buttonsPushed.length;")  # the task's own record of clicks so far
    return click(page.need("#subbtn2" if pushed else "#subbtn"))


def focus_text(page: Page) -> str:
    return click(page.need("#tt"))


def focus_text_2(page: Page) -> str:
    position = page.match(r"Focus into the (\d)(?:st|nd|rd|th) input textbox\.")[1]
    return click(page.need(f"#area input:nth-of-type({position})"))


def simple_arithmetic(page: Page) -> str:
    page.match(r"Solve the math problem and type your answer into the textbox\. Press submit when done\.")
    problem = page.js("return document.getElementById('math-problem').textContent;")
    m = re.fullmatch(r"\s*(\d+) ([-+x]) (\d+) =\s*", problem)
    if m is None:
        raise OracleError(f"simple-arithmetic: cannot read {problem!r}")
    a, op, b = int(m[1]), m[2], int(m[3])
    answer = a + b if op == "+" else a - b if op == "-" else a * b
    return fill_then_click(page, [("#math-answer", str(answer))], "#subbtn")


def find_word(page: Page) -> str:
    """The n-th whitespace-separated word of the paragraph, without punctuation (as the task compares)."""
    n = int(page.match(r'Find the (\d+)(?:st|nd|rd|th) word in the paragraph, type that into the textbox and press "Submit"\.')[1])
    words = page.js("return document.querySelector('#area p').textContent.trim().split(/\\s+/);")
    return fill_then_click(page, [("#answer-input", re.sub(r"[^a-zA-Z]", "", words[n - 1]))], "#subbtn")


def read_table(page: Page) -> str:
    key = page.match(r"Enter the value of (.*) into the text field and press Submit\.")[1]
    rows = page.js("return Array.from(document.querySelectorAll('#tab tr')).map((r) => Array.from(r.cells).map((c) => c.textContent));")
    value = next((row[1] for row in rows if row[0] == key), None)
    if value is None:
        raise OracleError(f"read-table: no row {key!r}")
    return fill_then_click(page, [("#tt", value)], "#subbtn")


def use_autocomplete(page: Page) -> str:
    """Types a country that fits the task (from the task's own list); closes the suggestions over Submit."""
    m = page.match(r'Enter an item that starts with "(.*?)"(?: and ends with "(.*)")?\.')
    item = page.js("return ui_utils.COUNTRIES.find((c) => c.startsWith(arguments[0]) && c.endsWith(arguments[1]));",
                   m[1], m[2] or "")
    if page.value("#tags") != item:
        return type_into(page.need("#tags"), item)
    if page.js("const menu = document.querySelector('ul.ui-autocomplete'); return !!menu && menu.offsetHeight > 0;"):
        return f"press [{page.need('#tags')}] Escape"
    return click(page.need("#subbtn"))


def click_collapsible_2(page: Page) -> str:
    """Clicks the link once its section is open, else the header of its section."""
    text = page.match(r'Expand the sections below, to find and click on the link "(.*)"\.')[1]
    ref = page.ref("#area span.alink", text)
    if ref is not None:
        return click(ref)
    header = page.js("""const link = Array.from(document.querySelectorAll('#area span.alink')).find((s) => s.textContent === arguments[0]);
        return link ? link.closest('div').previousElementSibling.id : null;""", text)
    if header is None:
        raise OracleError(f"click-collapsible-2: no link {text!r}")
    return click(page.need(f"#{header}"))


def scroll_text_2(page: Page) -> str:
    """Scrolls the textarea a screen at a time until it is at the end the task names, then submits."""
    end = page.match(r"Scroll the textarea to the (top|bottom) of the text hit submit\.")[1]
    top, room = page.js("const t = document.getElementById('text-area'); return [t.scrollTop, t.scrollHeight - t.clientHeight];")
    if end == "top" and top > 1:
        return f"scroll [{page.need('#text-area')}] up"
    if end == "bottom" and top < room - 1:
        return f"scroll [{page.need('#text-area')}] down"
    return click(page.need("#subbtn"))


_EMAIL = r"Find the email by (.*) and (?:click the (trash|star) icon to (?:delete it|mark it as important)|reply to them with the text \"(.*)\"|forward that email to (.*))\."


def email_inbox(page: Page) -> str:
    """Trash or star the sender's thread in the inbox; or open it, reply or forward, fill in and send."""
    sender, icon, reply, forward_to = page.match(_EMAIL).groups()
    thread = page.js("""const norm = (s) => s.replace(/\\s+/g, ' ').trim();
        const all = Array.from(document.querySelectorAll('#main .email-thread'));
        const t = all.find((t) => norm(t.querySelector('.email-sender').textContent) === arguments[0]);
        return t ? t.dataset.index : null;""", sender)
    opened = page.js("return [!!document.getElementById('email'), !!document.getElementById('reply'), !!document.getElementById('forward')];")
    if icon:
        if thread is None:
            raise OracleError(f"email-inbox: no thread by {sender!r}")
        return click(page.need(f"#main .email-thread[data-index='{thread}'] span.{icon}"))
    if opened[1]:
        return fill_then_click(page, [("#reply-text", reply)], "#send-reply")
    if opened[2]:
        return fill_then_click(page, [("#forward .forward-sender", forward_to)], "#send-forward")
    if opened[0]:
        return click(page.need("#email .email-reply" if reply is not None else "#email .email-forward"))
    if thread is None:
        raise OracleError(f"email-inbox: no thread by {sender!r}")
    return click(page.need(f"#main .email-thread[data-index='{thread}'] .email-sender"))


SOLVERS: dict[str, Callable[[Page], str]] = {
    "choose-list": choose_list,
    "click-button": click_button,
    "click-button-sequence": click_button_sequence,
    "click-checkboxes": click_checkboxes,
    "click-collapsible-2-nodelay": click_collapsible_2,
    "click-collapsible-nodelay": click_collapsible,
    "click-dialog": click_dialog,
    "click-dialog-2": click_dialog_2,
    "click-link": click_link,
    "click-option": click_option,
    "click-tab": click_tab,
    "click-tab-2": click_tab_2,
    "click-tab-2-easy": click_tab_2,
    "click-tab-2-hard": click_tab_2,
    "click-tab-2-medium": click_tab_2,
    "click-test": click_test,
    "click-test-2": click_test_2,
    "email-inbox": email_inbox,
    "email-inbox-delete": email_inbox,
    "email-inbox-important": email_inbox,
    "email-inbox-noscroll": email_inbox,
    "email-inbox-reply": email_inbox,
    "enter-password": enter_password,
    "enter-text": enter_text,
    "enter-text-2": enter_text_2,
    "enter-text-dynamic": enter_text,
    "find-word": find_word,
    "focus-text": focus_text,
    "focus-text-2": focus_text_2,
    "login-user": login_user,
    "navigate-tree": navigate_tree,
    "read-table": read_table,
    "scroll-text-2": scroll_text_2,
    "simple-arithmetic": simple_arithmetic,
    "unicode-test": click_button,
    "use-autocomplete-nodelay": use_autocomplete,
}
