"""Multi-turn search (the Search-R1 / AgentGym SearchQA role) over a BM25-indexed fact corpus.

AgentGym SearchQA's interaction format: the agent writes `<search>query</search>` and gets the
top `TOP_K` documents back as `<information>Doc 1(Title: ...) ...</information>`, or writes
`<answer>...</answer>`. The first `<search>`/`<answer>` tag of a turn decides the action (the
answer text is the last `<answer>` block, as AgentGym's scorer reads it). Reward: 1 when the
answer equals a gold answer after SQuAD normalisation (lower case, no punctuation or articles),
else 0; `info` carries `em` and token `f1`. Departures from AgentGym: an answer ends the episode
whether right or wrong (theirs lets a wrong answer try again, which rewards guessing), and an
episode ends unanswered after `MAX_TURNS` turns; queries are cut at `MAX_QUERY_CHARS`; a query
without any indexed word answers that no document matches.

The corpus and questions are `corpus.py`'s (built once per machine). Oracle: the question's
planned searches, one per hop, then the gold answer.
"""

from __future__ import annotations

import collections
import re
import string
from typing import ClassVar

from agentgym_jax.envs.protocol import StepResult, TaskInfo
from environments.base import Environment, every_kth_held_out
from environments.search import corpus

MAX_TURNS = 10  # searches + the answer; far above the 3 hops the longest question needs
TEST_EVERY = 10  # task ids divisible by this form the test split
MAX_QUERY_CHARS = 500  # a longer query is cut here (a 100 KB query would hold the event loop for seconds)

INSTRUCTION = (
    "Answer the question using a search engine over a collection of short documents about "
    "countries and cities. Think inside <think>...</think> first. To look something up, write "
    "<search>your query</search> and stop; the documents found come back inside "
    "<information>...</information>. Search as often as you need, one query per turn. When you "
    "know the answer, write it inside <answer>...</answer>, e.g. <answer> Beijing </answer>; "
    "the answer ends the episode."
)
INVALID = (
    "Your previous action is invalid. To search, put the query between <search> and </search>. "
    "To give the final answer, put it between <answer> and </answer>. Please try again."
)
NOTHING_FOUND = "No document matches the query: it has no word the documents use (besides stopwords)."
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation (what AgentGym's exact match applies): case, punctuation, articles."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str, golds: tuple[str, ...]) -> bool:
    return any(normalize_answer(prediction) == normalize_answer(g) for g in golds)


def f1_score(prediction: str, golds: tuple[str, ...]) -> float:
    """The best token-overlap F1 against any gold answer (SQuAD's definition)."""
    best = 0.0
    predicted = normalize_answer(prediction).split()
    for gold in golds:
        wanted = normalize_answer(gold).split()
        common = sum((collections.Counter(predicted) & collections.Counter(wanted)).values())
        if common:
            precision, recall = common / len(predicted), common / len(wanted)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def first_tag(text: str) -> tuple[str, str] | None:
    """(kind, content) of the first `<search>...</search>` or `<answer>...</answer>` block, or None.

    The block that opens first wins, as AgentGym reads a turn; a tag that is never closed does
    not count. Linear time (a regex with a lazy group is quadratic on `<search>` repeated).
    """
    found = []
    for kind in ("search", "answer"):
        opening, closing = f"<{kind}>", f"</{kind}>"
        start = text.find(opening)
        if start >= 0 and text.rfind(closing) >= start + len(opening):  # the earliest opening that is closed
            found.append((start, kind))
    if not found:
        return None
    start, kind = min(found)
    content_start = start + len(kind) + 2
    return kind, text[content_start:text.find(f"</{kind}>", content_start)]


def last_answer(text: str) -> str:
    """The content of the last closed `<answer>...</answer>` block (blocks read left to right, not nested)."""
    answer, position = "", 0
    while (start := text.find("<answer>", position)) >= 0:
        end = text.find("</answer>", start + 8)
        if end < 0:
            break
        answer, position = text[start + 8:end], end + 9
    return answer


def render_information(documents: list[corpus.Document]) -> str:
    """AgentGym SearchQA's layout: `Doc i(Title: t) text` per line, inside <information>."""
    lines = "\n".join(f"Doc {i + 1}(Title: {d.title}) {d.text}" for i, d in enumerate(documents))
    return f"<information>{lines or NOTHING_FOUND}</information>"


class SearchEnv(Environment):
    """One question, answered by searching."""

    name: ClassVar[str] = "search"
    instruction: ClassVar[str] = INSTRUCTION

    def __init__(self) -> None:
        self.question: corpus.Question | None = None
        self.searches: list[str] = []
        self.turns = 0
        self.answer: str | None = None
        self._observation = ""

    @classmethod
    def task_info(cls) -> TaskInfo:
        questions = corpus.load().questions
        return TaskInfo(
            env=cls.name,
            instruction=cls.instruction,
            success_threshold=cls.success_threshold,
            splits=every_kth_held_out(len(questions), TEST_EVERY),
            num_tasks=len(questions),
            has_oracle=cls.has_oracle,
            metadata={"hops": [q.hops for q in questions], "templates": dict(corpus.TEMPLATES),
                      "top_k": corpus.TOP_K, "max_turns": MAX_TURNS,
                      "num_documents": len(corpus.load().documents), "corpus_version": corpus.CORPUS_VERSION},
        )

    @classmethod
    def parse_action(cls, text: str) -> str | None:
        """The whole reply: the tags may sit anywhere in it (AgentGym's server reads raw output)."""
        return text.strip() or None

    def reset(self, data_idx: int) -> str:
        questions = corpus.load().questions
        if not 0 <= data_idx < len(questions):
            raise ValueError(f"search task id {data_idx} out of range [0, {len(questions)})")
        self.question = questions[data_idx]
        self.searches, self.turns, self.answer = [], 0, None
        self._observation = f"Question: {self.question.question}"
        return self._observation

    def step(self, action: str) -> StepResult:
        self.turns += 1
        out_of_turns = self.turns >= MAX_TURNS
        kind, content = first_tag(action) or (None, "")
        content = content.strip()
        if kind == "answer":
            self.answer = last_answer(action).strip()
            em = exact_match(self.answer, self.question.answers)
            verdict = "correct" if em else "incorrect"
            self._observation = f"Your answer is {verdict}. The episode is over."
            return self.result(self._observation, float(em), True, invalid=False, em=float(em),
                               f1=f1_score(self.answer, self.question.answers), searches=len(self.searches))
        if kind == "search" and content:
            self.searches.append(content)
            self._observation = render_information(corpus.load().search(content[:MAX_QUERY_CHARS]))
            invalid = False
        else:
            self._observation, invalid = INVALID, True
        if out_of_turns:
            self._observation += f"\nYou have used all {MAX_TURNS} turns without an answer. The episode is over."
        return self.result(self._observation, 0.0, out_of_turns, invalid=invalid, em=0.0, f1=0.0,
                           searches=len(self.searches))

    def observation(self) -> str:
        return self._observation

    def available_actions(self) -> list[str]:
        """The two action forms (any query or answer text is allowed inside them)."""
        return ["<search>your query</search>", "<answer>your answer</answer>"]

    def verify(self) -> bool:
        return self.answer is not None and exact_match(self.answer, self.question.answers)

    def oracle_action(self) -> str:
        """The first planned search (one per hop) not made yet, then the gold answer."""
        for query, _ in self.question.plan:
            if query not in self.searches:
                return f"<search>{query}</search>"
        return f"<answer>{self.question.answers[0]}</answer>"
