"""Academia (AgentGym's tool environment) on a real bibliography: OpenAlex records of 613 papers
on scientometrics, shipped by `biblium` as a sample data set.

AgentGym's Academia loads a DBLP extract (its PaperNet of citations and AuthorNet of
collaborations); here both graphs are built from the OpenAlex export: a paper's node holds its
authors, year, venue and OpenAlex citation count; PaperNet has an edge from each paper to every
paper of the set it cites; AuthorNet links authors who wrote a paper together, the edge holding
those papers. Papers without a title are left out; a title that OpenAlex holds twice is one
node (the lower OpenAlex id). An author's organisation is the one named on their latest paper
whose affiliations line up with its authors. Tools and their messages follow AgentGym's (the
graphs must be loaded first).
"""

from __future__ import annotations

import ast
import csv
import dataclasses
import functools
import itertools
import random
from typing import Any, Callable, ClassVar, Iterator

from agentgym_jax.envs.protocol.tool_calls import ToolCall
from environments.tools import data
from environments.tools.base import (
    Result, Step, Tool, ToolEnvironment, ToolTask, arg, failure)

PER_TEMPLATE = 25
TASKS_VERSION = "academia-v1"
GRAPHS = ("PaperNet", "AuthorNet")
OPENALEX_FILE = "open alex dataset.csv"


@dataclasses.dataclass
class Paper:
    title: str
    authors: list[str]
    year: int
    venue: str | None
    n_citation: int
    cites: list[str] = dataclasses.field(default_factory=list)  # titles of cited papers in the set

    def node(self) -> dict[str, Any]:
        return {"authors": self.authors, "year": self.year, "venue": self.venue, "n_citation": self.n_citation}


@dataclasses.dataclass
class Author:
    name: str
    papers: list[str] = dataclasses.field(default_factory=list)
    org: str | None = None
    org_year: int = -1

    def node(self) -> dict[str, Any]:
        return {"name": self.name, "org": self.org, "papers": self.papers}


@dataclasses.dataclass
class Graphs:
    papers: dict[str, Paper]
    authors: dict[str, Author]
    collaborations: dict[frozenset[str], list[str]]  # author pair -> papers written together
    collaborators: dict[str, list[str]]  # author -> sorted collaborators


def _institutions(row: dict[str, str], count: int) -> list[str | None]:
    """Per-author institution names, or all None where the export's lists do not line up."""
    parts = row["authorships.institutions"].split("|")
    if len(parts) != count:
        return [None] * count
    names = []
    for part in parts:
        try:
            names.append(ast.literal_eval(part)["display_name"] if part else None)
        except (ValueError, SyntaxError, KeyError, TypeError):
            names.append(None)
    return names


@functools.lru_cache(maxsize=None)
def graphs() -> Graphs:
    with open(data.biblium_file(OPENALEX_FILE), newline="", encoding="utf-8") as f:
        rows = sorted((r for r in csv.DictReader(f) if r["display_name"].strip()), key=lambda r: r["id"])
    title_of: dict[str, str] = {}  # OpenAlex id -> the node's title
    papers: dict[str, Paper] = {}
    authors: dict[str, Author] = {}
    references: dict[str, list[str]] = {}
    for row in rows:
        title = " ".join(row["display_name"].split())
        title_of[row["id"]] = title
        if title in papers:
            continue
        names = [n.strip() for n in row["authorships.author.display_name"].split("|") if n.strip()]
        papers[title] = Paper(title, names, int(row["publication_year"]), row["primary_location.source.display_name"] or None,
                              int(row["cited_by_count"]))
        references[title] = row["referenced_works"].split("|") if row["referenced_works"] else []
        for name, org in zip(names, _institutions(row, len(names))):
            author = authors.setdefault(name, Author(name))
            author.papers.append(title)
            if org and papers[title].year >= author.org_year:
                author.org, author.org_year = org, papers[title].year
    for title, ids in references.items():
        papers[title].cites = sorted({title_of[i] for i in ids if i in title_of and title_of[i] != title})
    collaborations: dict[frozenset[str], list[str]] = {}
    for paper in papers.values():
        for a, b in itertools.combinations(sorted(set(paper.authors)), 2):
            collaborations.setdefault(frozenset((a, b)), []).append(paper.title)
    collaborators: dict[str, set[str]] = {name: set() for name in authors}
    for a, b in map(sorted, collaborations):
        collaborators[a].add(b)
        collaborators[b].add(a)
    return Graphs(papers, authors, collaborations, {name: sorted(c) for name, c in collaborators.items()})


def _pair_key(a: str, b: str) -> str:
    return "|".join(sorted((a, b)))


GRAPH_ARG = arg("graph", "string", "The name of the graph to check", enum=list(GRAPHS))
TOOLS = (
    Tool("loadPaperNet", "Load PaperNet. In this net, nodes are papers and edges are citation relationships between papers.",
         returns="A message that PaperNet is loaded."),
    Tool("loadAuthorNet", "Load AuthorNet. In this net, nodes are authors and edges are collaboration relationships "
         "between authors.", returns="A message that AuthorNet is loaded."),
    Tool("neighbourCheck", "List the first-order neighbors connect to the node. In paperNet, neigbours are cited papers "
         "of the paper. In authorNet, neigbours are collaborators of the author.",
         dict([GRAPH_ARG, arg("node", "string", "The node for which neighbors will be listed")]), ("graph", "node"),
         "The neighbors."),
    Tool("paperNodeCheck", "Return detailed attribute information of a specified paper in PaperNet",
         dict([arg("node", "string", "Name of the paper.")]), ("node",),
         "The authors, published year, venue and number of citations (OpenAlex) of the paper."),
    Tool("authorNodeCheck", "Return detailed attribute information of a specified author in AuthorNet",
         dict([arg("node", "string", "name of the author.")]), ("node",),
         "The name, organization and papers (in the net) of the author."),
    Tool("authorEdgeCheck", "Return detailed attribute information of the edge between two specified nodes in a AuthorNet.",
         dict([arg("node1", "string", "The first node of the edge"), arg("node2", "string", "The second node of the edge")]),
         ("node1", "node2"), "All papers that the two authors have co-authored."),
    Tool("paperEdgeCheck", "Return detailed attribute information of the edge between two specified nodes in a PaperNet.",
         dict([arg("node1", "string", "The first node of the edge"), arg("node2", "string", "The second node of the edge")]),
         ("node1", "node2"), "Which of the two papers cites the other, if either does."),
)
EXAMPLE = (
    "Goal: When was the paper 'Networks of Scientific Papers' published?\n"
    "Thought: Paper information lives in PaperNet, which I load first.\n\nAction: loadPaperNet with Action Input: {}\n"
    "Observation: PaperNet is loaded.\nThought: Now I check the paper's node.\n\n"
    "Action: paperNodeCheck with Action Input: {\"node\": \"Networks of Scientific Papers\"}\n"
    "Observation: {\"authors\": [\"Derek J. de Solla Price\"], \"year\": 1965, \"venue\": \"Science\", \"n_citation\": 3078}\n"
    "Thought: It was published in 1965.\n\nAction: finish with Action Input: {\"answer\": 1965}\nObservation: 1965\n"
)
INTRO = (
    "You can use actions to help people solve problems about papers on scientometrics and their authors "
    "(an OpenAlex bibliography).")
RULES = "Load a graph before checking its nodes or edges. Name papers by their exact titles and authors by their full names."


# ---- tasks ----

TaskMaker = Callable[[random.Random, Graphs], Iterator[ToolTask]]
TEMPLATES: dict[str, TaskMaker] = {}


def template(fn: TaskMaker) -> TaskMaker:
    TEMPLATES[fn.__name__] = fn
    return fn


def _step(tool: str, facts: set[str] | frozenset[str], **arguments: Any) -> Step:
    return Step(ToolCall(tool, arguments), frozenset(facts))


LOAD_PAPERS = _step("loadPaperNet", {"load:PaperNet"})
LOAD_AUTHORS = _step("loadAuthorNet", {"load:AuthorNet"})


def _paper_node(title: str) -> Step:
    return _step("paperNodeCheck", {f"paper:{title}"}, node=title)


def _author_node(name: str) -> Step:
    return _step("authorNodeCheck", {f"author:{name}"}, node=name)


def _neighbours(graph: str, node: str) -> Step:
    return _step("neighbourCheck", {f"neighbours:{graph}:{node}"}, graph=graph, node=node)


def _sample(rng: random.Random, items: list[Any], k: int = PER_TEMPLATE) -> list[Any]:
    return rng.sample(items, min(k, len(items)))


def _most_cited(g: Graphs, titles: list[str]) -> str | None:
    ranked = sorted(titles, key=lambda t: -g.papers[t].n_citation)
    if len(ranked) < 2 or g.papers[ranked[0]].n_citation == g.papers[ranked[1]].n_citation:
        return None
    return ranked[0]


@template
def mutual_collaborators(rng: random.Random, g: Graphs) -> Iterator[ToolTask]:
    pairs = set()
    for middle in sorted(g.authors):  # a and b share a collaborator: both are neighbours of one
        pairs |= set(itertools.combinations(g.collaborators[middle], 2))
    pairs = [(a, b, len(set(g.collaborators[a]) & set(g.collaborators[b]))) for a, b in sorted(pairs)]
    for a, b, count in _sample(rng, pairs):
        yield ToolTask(f"How many mutual collaborators do {a} and {b} share? Please give me a numerical value as an answer.",
                       count, (LOAD_AUTHORS, _neighbours("AuthorNet", a), _neighbours("AuthorNet", b)), "mutual_collaborators")


@template
def most_cited_paper(rng: random.Random, g: Graphs) -> Iterator[ToolTask]:
    names = [n for n in sorted(g.authors) if _most_cited(g, g.authors[n].papers)]
    for name in _sample(rng, names):
        best = _most_cited(g, g.authors[name].papers)
        plan = (LOAD_AUTHORS, _author_node(name), LOAD_PAPERS) + tuple(_paper_node(t) for t in g.authors[name].papers)
        yield ToolTask(f"Which paper by {name} has the most citations? Please answer with the paper's title.",
                       best, plan, "most_cited_paper")


@template
def coauthors_of_most_cited(rng: random.Random, g: Graphs) -> Iterator[ToolTask]:
    names = [n for n in sorted(g.authors) if (best := _most_cited(g, g.authors[n].papers)) and len(g.papers[best].authors) > 1]
    for name in _sample(rng, names):
        best = _most_cited(g, g.authors[name].papers)
        plan = (LOAD_AUTHORS, _author_node(name), LOAD_PAPERS) + tuple(_paper_node(t) for t in g.authors[name].papers)
        yield ToolTask(f"Who are the co-authors with whom {name} wrote their paper with the most citations? Please answer "
                       "in the form of a list ['author1', 'author2', ...].",
                       sorted(a for a in g.papers[best].authors if a != name), plan, "coauthors_of_most_cited")


@template
def paper_count(rng: random.Random, g: Graphs) -> Iterator[ToolTask]:
    names = [n for n in sorted(g.authors) if len(g.authors[n].papers) >= 2]
    for name in _sample(rng, names):
        yield ToolTask(f"How many papers by {name} are in the PaperNet? Please give me a numerical value as an answer.",
                       len(g.authors[name].papers), (LOAD_AUTHORS, _author_node(name)), "paper_count")


@template
def paper_year(rng: random.Random, g: Graphs) -> Iterator[ToolTask]:
    for title in _sample(rng, sorted(g.papers)):
        yield ToolTask(f"In which year was the paper '{title}' published? Please give me a numerical value as an answer.",
                       g.papers[title].year, (LOAD_PAPERS, _paper_node(title)), "paper_year")


@template
def paper_venue(rng: random.Random, g: Graphs) -> Iterator[ToolTask]:
    for title in _sample(rng, sorted(t for t, p in g.papers.items() if p.venue)):
        yield ToolTask(f"Where was the paper '{title}' published? Please answer with the venue's name.",
                       g.papers[title].venue, (LOAD_PAPERS, _paper_node(title)), "paper_venue")


@template
def cites(rng: random.Random, g: Graphs) -> Iterator[ToolTask]:
    citing = [(t, c) for t in sorted(g.papers) for c in g.papers[t].cites]
    titles = sorted(g.papers)
    for k in range(PER_TEMPLATE):
        if k % 2 == 0:
            a, b = rng.choice(citing)
        else:
            a, b = rng.sample(titles, 2)
            if b in g.papers[a].cites:
                continue
        answer = "Yes" if b in g.papers[a].cites else "No"
        yield ToolTask(f"Does the paper '{a}' cite the paper '{b}'? Please answer with 'Yes' or 'No'.", answer,
                       (LOAD_PAPERS, _step("paperEdgeCheck", {f"paperedge:{_pair_key(a, b)}"}, node1=a, node2=b)), "cites")


@template
def references_in_net(rng: random.Random, g: Graphs) -> Iterator[ToolTask]:
    for title in _sample(rng, sorted(t for t, p in g.papers.items() if p.cites)):
        yield ToolTask(f"How many papers in the PaperNet does the paper '{title}' cite? Please give me a numerical value "
                       "as an answer.", len(g.papers[title].cites), (LOAD_PAPERS, _neighbours("PaperNet", title)),
                       "references_in_net")


@template
def organization(rng: random.Random, g: Graphs) -> Iterator[ToolTask]:
    for name in _sample(rng, sorted(n for n, a in g.authors.items() if a.org)):
        yield ToolTask(f"Which organization is {name} affiliated with? Please answer with the organization's name.",
                       g.authors[name].org, (LOAD_AUTHORS, _author_node(name)), "organization")


@template
def coauthored_papers(rng: random.Random, g: Graphs) -> Iterator[ToolTask]:
    for pair in _sample(rng, sorted(g.collaborations, key=sorted)):
        a, b = sorted(pair)
        yield ToolTask(f"Which papers have {a} and {b} written together? Please answer in the form of a list "
                       "['title1', 'title2', ...].", sorted(g.collaborations[pair]),
                       (LOAD_AUTHORS, _step("authorEdgeCheck", {f"authoredge:{_pair_key(a, b)}"}, node1=a, node2=b)),
                       "coauthored_papers")


@template
def most_cited_reference(rng: random.Random, g: Graphs) -> Iterator[ToolTask]:
    for title in _sample(rng, sorted(t for t, p in g.papers.items() if _most_cited(g, p.cites))):
        refs = g.papers[title].cites
        plan = (LOAD_PAPERS, _neighbours("PaperNet", title)) + tuple(_paper_node(t) for t in refs)
        yield ToolTask(f"Among the papers in the PaperNet that '{title}' cites, which one has the most citations? "
                       "Please answer with the paper's title.", _most_cited(g, refs), plan, "most_cited_reference")


@functools.lru_cache(maxsize=None)
def academia_tasks() -> tuple[ToolTask, ...]:
    g = graphs()
    tasks = [t for name, make in TEMPLATES.items() for t in make(random.Random(f"{TASKS_VERSION}:{name}"), g)]
    random.Random(TASKS_VERSION).shuffle(tasks)
    return tuple(tasks)


class AcademiaEnv(ToolEnvironment):
    """Questions about papers and authors answered from the two graphs; loading is the only state."""

    name: ClassVar[str] = "academia"
    intro: ClassVar[str] = INTRO
    rules: ClassVar[str] = RULES
    example: ClassVar[str] = EXAMPLE
    tools: ClassVar[tuple[Tool, ...]] = TOOLS

    @classmethod
    def all_tasks(cls) -> tuple[ToolTask, ...]:
        return academia_tasks()

    def start(self, task: ToolTask) -> None:
        self.loaded: set[str] = set()

    def _load(self, graph: str) -> Result:
        self.loaded.add(graph)
        return Result(f"{graph} is loaded.", frozenset({f"load:{graph}"}))

    def tool_loadPaperNet(self) -> Result:
        return self._load("PaperNet")

    def tool_loadAuthorNet(self) -> Result:
        return self._load("AuthorNet")

    def _node(self, graph: str, node: str) -> Result | None:
        """None when `node` is a node of the loaded `graph`; else the failure to answer."""
        if graph not in self.loaded:
            return failure(f"Please load the {graph} first.")
        nodes = graphs().papers if graph == "PaperNet" else graphs().authors
        if node not in nodes:
            return failure(f"There is no node named {node} in the {graph}.")
        return None

    def tool_neighbourCheck(self, graph: str, node: str) -> Result:
        if refused := self._node(graph, node):
            return refused
        g = graphs()
        neighbours = g.papers[node].cites if graph == "PaperNet" else g.collaborators[node]
        return Result(neighbours, frozenset({f"neighbours:{graph}:{node}"}))

    def tool_paperNodeCheck(self, node: str) -> Result:
        if refused := self._node("PaperNet", node):
            return refused
        return Result(graphs().papers[node].node(), frozenset({f"paper:{node}"}))

    def tool_authorNodeCheck(self, node: str) -> Result:
        if refused := self._node("AuthorNet", node):
            return refused
        return Result(graphs().authors[node].node(), frozenset({f"author:{node}"}))

    def tool_authorEdgeCheck(self, node1: str, node2: str) -> Result:
        if refused := self._node("AuthorNet", node1) or self._node("AuthorNet", node2):
            return refused
        papers = graphs().collaborations.get(frozenset((node1, node2)))
        fact = frozenset({f"authoredge:{_pair_key(node1, node2)}"})
        if not papers:
            return Result(f"There is no edge between {node1} and {node2} in the AuthorNet.", fact)
        return Result({"papers": papers}, fact)

    def tool_paperEdgeCheck(self, node1: str, node2: str) -> Result:
        if refused := self._node("PaperNet", node1) or self._node("PaperNet", node2):
            return refused
        g = graphs()
        fact = frozenset({f"paperedge:{_pair_key(node1, node2)}"})
        forward, backward = node2 in g.papers[node1].cites, node1 in g.papers[node2].cites
        if not (forward or backward):
            return Result(f"There is no edge between {node1} and {node2} in the PaperNet.", fact)
        return Result({"node1_cites_node2": forward, "node2_cites_node1": backward}, fact)
