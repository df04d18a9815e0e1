"""Sheet (AgentGym's tool environment): a stateful spreadsheet, verified against the goal sheet.

AgentGym's Sheet edits a Google Sheets workbook through gspread; here the same tools act on a
workbook held in the session. Its two sheets hold real tables: "Sheet1" a sample of the cars
of vega-datasets (the UCI Auto MPG data: name, mpg, cylinders, horsepower, weight, origin) and
"Sheet2" a run of days of Seattle weather (vega-datasets, NOAA). Rows and cells are 1-based and
row 1 is the header, as in a spreadsheet; positions are A1 notation.

Operations are checked by comparing every sheet with the goal workbook (numbers to 1e-6);
questions by the answer, with the workbook unchanged. Progress follows AgentGym's cell match
degree, counted over the cells the goal changes: the share of them already right is one
sub-goal, beside the opened sheet, the values read and the answer.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import random
from typing import Any, Callable, ClassVar

from agentgym_jax.envs.protocol.tool_calls import ToolCall
from environments.tools import data
from environments.tools.base import (
    Result, Step, Tool, ToolEnvironment, ToolTask, arg, failure)

TASKS_VERSION = "sheet-v1"
PER_TEMPLATE = 20
CAR_ROWS, DAY_ROWS = 10, 10
CAR_COLUMNS = ("Name", "Miles_per_Gallon", "Cylinders", "Horsepower", "Weight_in_lbs", "Origin")
DAY_COLUMNS = ("date", "precipitation", "temp_max", "temp_min", "wind", "weather")
OPERATORS = ("SUM", "AVERAGE", "COUNT", "MAX", "MIN")
MAX_CELLS = 10_000  # a sheet never grows past this many cells

Cell = Any  # str | int | float | None
Table = list[list[Cell]]


@functools.lru_cache(maxsize=None)
def cars() -> tuple[tuple[Cell, ...], ...]:
    with open(data.vega_file("cars.json"), encoding="utf-8") as f:
        rows = json.load(f)
    return tuple(tuple(r[c] for c in CAR_COLUMNS) for r in rows if all(r[c] is not None for c in CAR_COLUMNS))


@functools.lru_cache(maxsize=None)
def days() -> tuple[tuple[Cell, ...], ...]:
    rows = []
    for r in data.csv_rows(data.vega_file("seattle-weather.csv")):
        rows.append((r["date"].replace("/", "-"), float(r["precipitation"]), float(r["temp_max"]), float(r["temp_min"]),
                     float(r["wind"]), r["weather"]))
    return tuple(rows)


def make_workbook(rng: random.Random) -> dict[str, Table]:
    start = rng.randrange(len(days()) - DAY_ROWS)
    return {"Sheet1": [list(CAR_COLUMNS)] + [list(r) for r in rng.sample(cars(), CAR_ROWS)],
            "Sheet2": [list(DAY_COLUMNS)] + [list(r) for r in days()[start:start + DAY_ROWS]]}


# ---- A1 notation and cell comparison ----

def column_letter(col: int) -> str:
    letters = ""
    while col > 0:
        col, rest = divmod(col - 1, 26)
        letters = chr(65 + rest) + letters
    return letters


def a1(row: int, col: int) -> str:
    return f"{column_letter(col)}{row}"


def parse_a1(position: str) -> tuple[int, int]:
    """'B3' -> (3, 2); ValueError for anything else."""
    text = position.strip().upper()
    split = next((i for i, ch in enumerate(text) if not ("A" <= ch <= "Z")), len(text))
    letters, digits = text[:split], text[split:]
    if not letters or not digits.isdigit() or len(letters) > 3 or len(digits) > 6:
        raise ValueError(f"{position!r} is not a cell position in A1 notation (e.g. 'B3')")
    col = 0
    for letter in letters:
        col = col * 26 + ord(letter) - 64
    return int(digits), col


def same_cell(a: Cell, b: Cell) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool) and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-6)
    return ("" if a is None else str(a)) == ("" if b is None else str(b))


def cell_at(table: Table, row: int, col: int) -> Cell:
    return table[row - 1][col - 1] if row <= len(table) and col <= len(table[row - 1]) else None


def changed_cells(before: Table, after: Table) -> list[tuple[int, int]]:
    rows = max(len(before), len(after))
    cols = max([len(r) for r in before + after] or [0])
    return [(r, c) for r in range(1, rows + 1) for c in range(1, cols + 1)
            if not same_cell(cell_at(before, r, c), cell_at(after, r, c))]


def same_table(a: Table, b: Table) -> bool:
    return len(a) == len(b) and not changed_cells(a, b)


def apply_operator(operator: str, values: list[Cell]) -> float | int:
    numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if operator == "COUNT":
        return len(numbers)
    if not numbers:
        raise ValueError("no numbers in the range")
    result = {"SUM": sum, "MAX": max, "MIN": min, "AVERAGE": lambda v: sum(v) / len(v)}[operator](numbers)
    return round(result, 6) if isinstance(result, float) else result


POSITION = arg("position", "string", "Cell position in A1 annotation.")
START = arg("start_position", "string", "Starting cell position (top left) in A1 annotation.")
END = arg("end_position", "string", "Ending cell position (bottom right) in A1 annotation.")
OPERATOR = arg("operator", "string", "The operator to apply.", enum=list(OPERATORS))
VALUES = arg("values_list", "array", "A list of lists, each list containing one row's values.", items={"type": "array"})
TOOLS = (
    Tool("open_sheet", "Open a sheet by name.", dict([arg("name", "string", "The name of the sheet to open.")]), ("name",),
         "A message that the sheet is open."),
    Tool("get_A1_annotation", "Get the A1 annotation of a cell from its row and column numbers.",
         dict([arg("row", "integer", "Row index."), arg("col", "integer", "Column index.")]), ("row", "col"),
         "The A1 annotation of the cell."),
    Tool("get_all_values", "Get all the values of the open sheet.", returns="The rows of the sheet."),
    Tool("get_range_values", "Get the values of a range of cells.", dict([START, END]), ("start_position", "end_position"),
         "The rows of the range."),
    Tool("get_cell_value", "Get the value of a cell.", dict([POSITION]), ("position",), "The value of the cell."),
    Tool("filter_cells", "Find the cells whose value equals the query, optionally within one row or column.",
         dict([arg("query", "string", "The value to look for."), arg("in_row", "integer", "Row number to scope the search."),
               arg("in_column", "integer", "Column number to scope the search.")]), ("query",),
         "The A1 positions of the matching cells."),
    Tool("get_value_by_formula", "Apply an operator (SUM, AVERAGE, COUNT, MAX, MIN) to the numbers of a range.",
         dict([START, END, OPERATOR]), ("start_position", "end_position", "operator"), "The result."),
    Tool("update_cell", "Update the value of a cell.", dict([POSITION, arg("value", ["string", "number"], "The value to set.")]),
         ("position", "value"), "A message that the cell was updated."),
    Tool("update_cell_by_formula", "Write the result of an operator over a range into a cell.",
         dict([START, END, OPERATOR, arg("result_position", "string", "The cell to write the result into.")]),
         ("start_position", "end_position", "operator", "result_position"), "A message with the value written."),
    Tool("update_range", "Update a range of cells with a list of rows of values.", dict([START, END, VALUES]),
         ("start_position", "end_position", "values_list"), "A message that the range was updated."),
    Tool("insert_rows", "Insert rows before a row (by default after the last row).",
         dict([VALUES, arg("row_idx", "integer", "The row before which to insert (default: after the last row).")]),
         ("values_list",), "A message that the rows were inserted."),
    Tool("delete_batch_data", "Delete rows or columns.",
         dict([arg("dimension", "string", "The dimension to delete.", enum=["row", "col"]),
               arg("index_list", "array", "The 1-based indexes of the rows/cols to delete.", items={"type": "integer"})]),
         ("dimension", "index_list"), "A message that the data was deleted."),
    Tool("sort_sheet_by_col", "Sort the rows below the header by one column.",
         dict([arg("col_num", "integer", "The index of the sort column."),
               arg("order", "string", "The sort order.", enum=["asc", "des"])]), ("col_num", "order"),
         "A message that the sheet was sorted."),
)
EXAMPLE = (
    "Goal: In \"Sheet1\", what is the largest horsepower?\n"
    "Thought: I open the sheet first.\n\nAction: open_sheet with Action Input: {\"name\": \"Sheet1\"}\n"
    "Observation: You have open the Sheet1\nThought: Horsepower is column D; its values are in rows 2 to 11.\n\n"
    "Action: get_value_by_formula with Action Input: {\"start_position\": \"D2\", \"end_position\": \"D11\", "
    "\"operator\": \"MAX\"}\nObservation: 150\n"
    "Thought: The largest horsepower is 150.\n\nAction: finish with Action Input: {\"answer\": 150}\nObservation: 150\n"
)
INTRO = (
    "You can use actions to help people work with the sheets of a spreadsheet (\"Sheet1\": cars, \"Sheet2\": "
    "Seattle weather).")
RULES = (
    "Open a sheet before operating it. Rows and columns are numbered from 1 and row 1 is the header. Change only "
    "what the goal asks for. For a question, finish with the answer; for an operation, finish with the answer 'done'.")


# ---- tasks ----

TaskMaker = Callable[[random.Random, dict[str, Table], int], ToolTask | None]
TEMPLATES: dict[str, TaskMaker] = {}
SORTABLE = {"Sheet1": ("Miles_per_Gallon", "Horsepower", "Weight_in_lbs"), "Sheet2": ("precipitation", "temp_max", "wind")}


def template(fn: TaskMaker) -> TaskMaker:
    TEMPLATES[fn.__name__] = fn
    return fn


def _open(sheet: str) -> list[Step]:
    return [Step(ToolCall("open_sheet", {"name": sheet}), frozenset({f"open:{sheet}"})),
            Step(ToolCall("get_all_values", {}), frozenset({f"values:{sheet}"}))]


def _operation(goal: str, book: dict[str, Table], sheet: str, ops: list[ToolCall], name: str, seed: int) -> ToolTask:
    env = SheetEnv()
    env.book, env.sheet = copy.deepcopy(book), sheet
    for op in ops:
        result = getattr(env, f"tool_{op.name}")(**op.arguments)
        assert result.ok, (op, result.value)
    steps = _open(sheet) + [Step(op) for op in ops]
    return ToolTask(goal, None, tuple(steps), name, {"seed": seed, "goal_state": env.book})


def _question(goal: str, answer: Any, sheet: str, name: str, seed: int) -> ToolTask:
    return ToolTask(goal, answer, tuple(_open(sheet)), name, {"seed": seed, "goal_state": None})


def _column(book: dict[str, Table], sheet: str, header: str) -> tuple[int, list[Cell]]:
    col = book[sheet][0].index(header) + 1
    return col, [row[col - 1] for row in book[sheet][1:]]


@template
def sort_rows(rng: random.Random, book: dict[str, Table], seed: int) -> ToolTask | None:
    sheet = rng.choice(list(book))
    header = rng.choice(SORTABLE[sheet])
    col, values = _column(book, sheet, header)
    if len(set(values)) != len(values):
        return None
    order = rng.choice(["asc", "des"])
    words = "from the smallest to the largest" if order == "asc" else "from the largest to the smallest"
    return _operation(f"Please sort the rows of \"{sheet}\" by \"{header}\" {words}.", book, sheet,
                      [ToolCall("sort_sheet_by_col", {"col_num": col, "order": order})], "sort_rows", seed)


@template
def delete_rows_where(rng: random.Random, book: dict[str, Table], seed: int) -> ToolTask | None:
    sheet, header = rng.choice([("Sheet1", "Origin"), ("Sheet2", "weather")])
    col, values = _column(book, sheet, header)
    value = rng.choice(sorted(set(values)))
    rows = [i + 2 for i, v in enumerate(values) if v != value]
    if not rows or len(rows) == len(values):
        return None
    return _operation(f"In \"{sheet}\", keep only the rows whose \"{header}\" is \"{value}\": delete every other row "
                      "(keep the header).", book, sheet,
                      [ToolCall("delete_batch_data", {"dimension": "row", "index_list": rows})], "delete_rows_where", seed)


@template
def update_value(rng: random.Random, book: dict[str, Table], seed: int) -> ToolTask:
    col, names = _column(book, "Sheet1", "Name")
    row = rng.randrange(len(names)) + 2
    hp_col = book["Sheet1"][0].index("Horsepower") + 1
    new = book["Sheet1"][row - 1][hp_col - 1] + rng.choice([-10, -5, 5, 10])
    return _operation(f"The horsepower of the {names[row - 2]} in \"Sheet1\" was entered wrongly; please set it to {new}.",
                      book, "Sheet1", [ToolCall("update_cell", {"position": a1(row, hp_col), "value": new})],
                      "update_value", seed)


@template
def append_car(rng: random.Random, book: dict[str, Table], seed: int) -> ToolTask:
    present = {row[0] for row in book["Sheet1"][1:]}
    car = rng.choice([c for c in cars() if c[0] not in present])
    return _operation(f"Please add this car as a new last row of \"Sheet1\": {json.dumps(list(car))}.", book, "Sheet1",
                      [ToolCall("insert_rows", {"values_list": [list(car)]})], "append_car", seed)


@template
def write_total(rng: random.Random, book: dict[str, Table], seed: int) -> ToolTask:
    header = rng.choice(["precipitation", "wind"])
    operator = rng.choice(["SUM", "AVERAGE", "MAX"])
    col, values = _column(book, "Sheet2", header)
    below = a1(len(values) + 3, col)
    word = {"SUM": "total", "AVERAGE": "average", "MAX": "largest value"}[operator]
    return _operation(f"In \"Sheet2\", write the {word} of the \"{header}\" column into cell {below}.", book, "Sheet2",
                      [ToolCall("update_cell_by_formula", {"start_position": a1(2, col), "end_position": a1(len(values) + 1, col),
                                                           "operator": operator, "result_position": below})],
                      "write_total", seed)


@template
def delete_column(rng: random.Random, book: dict[str, Table], seed: int) -> ToolTask:
    sheet = rng.choice(list(book))
    header = rng.choice(book[sheet][0][1:])
    return _operation(f"Please remove the \"{header}\" column from \"{sheet}\".", book, sheet,
                      [ToolCall("delete_batch_data", {"dimension": "col", "index_list": [book[sheet][0].index(header) + 1]})],
                      "delete_column", seed)


@template
def best_car(rng: random.Random, book: dict[str, Table], seed: int) -> ToolTask | None:
    header = rng.choice(SORTABLE["Sheet1"])
    _, values = _column(book, "Sheet1", header)
    if sorted(values)[-1] == sorted(values)[-2]:
        return None
    name = book["Sheet1"][values.index(max(values)) + 1][0]
    return _question(f"Which car in \"Sheet1\" has the largest \"{header}\"? Please answer with the car's name.",
                     name, "Sheet1", "best_car", seed)


@template
def rainy_days(rng: random.Random, book: dict[str, Table], seed: int) -> ToolTask:
    _, values = _column(book, "Sheet2", "precipitation")
    return _question("On how many of the days in \"Sheet2\" was the precipitation above 0? Please answer with a number.",
                     sum(1 for v in values if v > 0), "Sheet2", "rainy_days", seed)


@template
def mean_value(rng: random.Random, book: dict[str, Table], seed: int) -> ToolTask:
    header = rng.choice(["temp_max", "temp_min", "wind"])
    _, values = _column(book, "Sheet2", header)
    return _question(f"What is the average \"{header}\" over the days in \"Sheet2\"? Please answer with a number rounded "
                     "to 1 decimal place.", round(sum(values) / len(values), 1), "Sheet2", "mean_value", seed)


@functools.lru_cache(maxsize=None)
def sheet_tasks() -> tuple[ToolTask, ...]:
    tasks = []
    for name, make in TEMPLATES.items():
        made, k = 0, 0
        while made < PER_TEMPLATE:
            seed = int.from_bytes(f"{name}{k}".encode(), "big") % 2**31
            k += 1
            task = make(random.Random(f"{TASKS_VERSION}:{name}:{k}"), make_workbook(random.Random(seed)), seed)
            if task is not None:
                tasks.append(task)
                made += 1
    random.Random(TASKS_VERSION).shuffle(tasks)
    return tuple(tasks)


class SheetEnv(ToolEnvironment):
    """A workbook per episode; operations are verified against the goal workbook."""

    name: ClassVar[str] = "sheet"
    intro: ClassVar[str] = INTRO
    rules: ClassVar[str] = RULES
    example: ClassVar[str] = EXAMPLE
    tools: ClassVar[tuple[Tool, ...]] = TOOLS

    @classmethod
    def all_tasks(cls) -> tuple[ToolTask, ...]:
        return sheet_tasks()

    def start(self, task: ToolTask) -> None:
        self.book = make_workbook(random.Random(task.setup["seed"]))
        self.initial = copy.deepcopy(self.book)
        self.goal_book = task.setup["goal_state"] or self.initial
        self.sheet: str | None = None

    # ---- state checks ----

    def state_progress(self) -> tuple[float, int]:
        changed = [(name, cell) for name in self.initial for cell in changed_cells(self.initial[name], self.goal_book[name])]
        if not changed:
            return 0, 0
        right = sum(same_cell(cell_at(self.book[name], *cell), cell_at(self.goal_book[name], *cell)) for name, cell in changed)
        return right / len(changed), 1

    def state_matches(self) -> bool:
        return all(same_table(self.book[name], self.goal_book[name]) for name in self.goal_book)

    def next_call(self) -> ToolCall:
        """The solution's next step while the workbook follows it; else a repair that writes the goal."""
        for step in self.task.plan:
            if step.facts and not step.facts <= self.facts:
                return step.call
        if self.state_matches():
            return super().next_call()
        sheet = next(name for name in self.goal_book if not same_table(self.book[name], self.goal_book[name]))
        if self.sheet != sheet:
            return ToolCall("open_sheet", {"name": sheet})
        if same_table(self.book[sheet], self.initial[sheet]):
            return next(step.call for step in self.task.plan if not step.facts)
        now, goal = self.book[sheet], self.goal_book[sheet]
        if len(now) > len(goal):
            return ToolCall("delete_batch_data", {"dimension": "row", "index_list": list(range(len(goal) + 1, len(now) + 1))})
        if len(now) < len(goal):
            return ToolCall("insert_rows", {"values_list": goal[len(now):]})
        width = max(len(r) for r in goal)
        if max(len(r) for r in now) > width:
            return ToolCall("delete_batch_data", {"dimension": "col", "index_list": list(range(width + 1, max(len(r) for r in now) + 1))})
        rows = [[("" if v is None else v) for v in r] + [""] * (width - len(r)) for r in goal]
        return ToolCall("update_range", {"start_position": "A1", "end_position": a1(len(goal), width), "values_list": rows})

    # ---- tools ----

    def _table(self) -> Table | Result:
        if self.sheet is None:
            return failure("Please open a sheet before operating it")
        return self.book[self.sheet]

    def _cell(self, position: str) -> tuple[int, int] | Result:
        try:
            row, col = parse_a1(position)
        except ValueError as e:
            return failure(f"Error: {e}.")
        if row < 1 or col < 1:
            return failure(f"Error: {position!r} is outside the sheet.")
        return row, col

    def _range(self, start: str, end: str) -> tuple[int, int, int, int] | Result:
        first, last = self._cell(start), self._cell(end)
        for cell in (first, last):
            if isinstance(cell, Result):
                return cell
        (r1, c1), (r2, c2) = first, last
        if r1 > r2 or c1 > c2:
            return failure("Error: start_position must be above and left of end_position.")
        if (r2 - r1 + 1) * (c2 - c1 + 1) > MAX_CELLS:
            return failure(f"Error: a range holds at most {MAX_CELLS} cells.")
        return r1, c1, r2, c2

    def _fits(self, table: Table, rows: int, cols: int) -> bool:
        return rows * max(cols, max((len(r) for r in table), default=0)) <= MAX_CELLS

    def _set(self, table: Table, row: int, col: int, value: Cell) -> None:
        while len(table) < row:
            table.append([])
        line = table[row - 1]
        while len(line) < col:
            line.append(None)
        line[col - 1] = value

    def tool_open_sheet(self, name: str) -> Result:
        if name not in self.book:
            return failure(f"Error: there is no sheet named {name!r}; the sheets are: {', '.join(self.book)}.")
        self.sheet = name
        return Result(f"You have open the {name}", frozenset({f"open:{name}"}))

    def tool_get_A1_annotation(self, row: int, col: int) -> Result:
        if not (1 <= row <= 10**6 and 1 <= col <= 18278):
            return failure("Error: row and col start at 1.")
        return Result(a1(row, col))

    def tool_get_all_values(self) -> Result:
        table = self._table()
        if isinstance(table, Result):
            return table
        return Result(table, frozenset({f"values:{self.sheet}"}))

    def tool_get_range_values(self, start_position: str, end_position: str) -> Result:
        table, bounds = self._table(), self._range(start_position, end_position)
        for refused in (table, bounds):
            if isinstance(refused, Result):
                return refused
        r1, c1, r2, c2 = bounds
        return Result([[cell_at(table, r, c) for c in range(c1, c2 + 1)] for r in range(r1, r2 + 1)])

    def tool_get_cell_value(self, position: str) -> Result:
        table, cell = self._table(), self._cell(position)
        for refused in (table, cell):
            if isinstance(refused, Result):
                return refused
        return Result(cell_at(table, *cell))

    def tool_filter_cells(self, query: str, in_row: int | None = None, in_column: int | None = None) -> Result:
        table = self._table()
        if isinstance(table, Result):
            return table
        found = [a1(r, c) for r, line in enumerate(table, start=1) for c, v in enumerate(line, start=1)
                 if same_cell(v, query) or (v is not None and str(v) == query)
                 if (in_row is None or r == in_row) and (in_column is None or c == in_column)]
        return Result(found)

    def tool_get_value_by_formula(self, start_position: str, end_position: str, operator: str) -> Result:
        table, bounds = self._table(), self._range(start_position, end_position)
        for refused in (table, bounds):
            if isinstance(refused, Result):
                return refused
        r1, c1, r2, c2 = bounds
        try:
            return Result(apply_operator(operator, [cell_at(table, r, c) for r in range(r1, r2 + 1) for c in range(c1, c2 + 1)]))
        except ValueError as e:
            return failure(f"Error: {e}.")

    def tool_update_cell(self, position: str, value: Cell) -> Result:
        table, cell = self._table(), self._cell(position)
        for refused in (table, cell):
            if isinstance(refused, Result):
                return refused
        if not self._fits(table, max(len(table), cell[0]), cell[1]):
            return failure(f"Error: a sheet holds at most {MAX_CELLS} cells.")
        self._set(table, *cell, value)
        return Result(f"Cell {position.strip().upper()} is updated.")

    def tool_update_cell_by_formula(self, start_position: str, end_position: str, operator: str, result_position: str) -> Result:
        value = self.tool_get_value_by_formula(start_position, end_position, operator)
        if not value.ok:
            return value
        written = self.tool_update_cell(result_position, value.value)
        return written if not written.ok else Result(f"Cell {result_position.strip().upper()} is set to {value.value}.")

    def tool_update_range(self, start_position: str, end_position: str, values_list: list[Any]) -> Result:
        table, bounds = self._table(), self._range(start_position, end_position)
        for refused in (table, bounds):
            if isinstance(refused, Result):
                return refused
        r1, c1, r2, c2 = bounds
        shape_ok = len(values_list) == r2 - r1 + 1 and all(isinstance(r, list) and len(r) == c2 - c1 + 1 for r in values_list)
        if not shape_ok:
            return failure(f"Error: values_list must hold {r2 - r1 + 1} rows of {c2 - c1 + 1} values for this range.")
        if not self._fits(table, max(len(table), r2), c2):
            return failure(f"Error: a sheet holds at most {MAX_CELLS} cells.")
        for r, line in enumerate(values_list, start=r1):
            for c, value in enumerate(line, start=c1):
                self._set(table, r, c, _plain(value))
        return Result(f"Range {a1(r1, c1)}:{a1(r2, c2)} is updated.")

    def tool_insert_rows(self, values_list: list[Any], row_idx: int | None = None) -> Result:
        table = self._table()
        if isinstance(table, Result):
            return table
        where = len(table) + 1 if row_idx is None else row_idx
        if not 1 <= where <= len(table) + 1:
            return failure(f"Error: row_idx must lie in 1..{len(table) + 1}.")
        if not all(isinstance(r, list) for r in values_list) or not values_list:
            return failure("Error: values_list must be a non-empty list of rows (lists of values).")
        if not self._fits(table, len(table) + len(values_list), max(len(r) for r in values_list)):
            return failure(f"Error: a sheet holds at most {MAX_CELLS} cells.")
        table[where - 1:where - 1] = [[_plain(v) for v in r] for r in values_list]
        return Result(f"{len(values_list)} row(s) inserted before row {where}.")

    def tool_delete_batch_data(self, dimension: str, index_list: list[Any]) -> Result:
        table = self._table()
        if isinstance(table, Result):
            return table
        if not index_list or not all(isinstance(i, int) and not isinstance(i, bool) for i in index_list):
            return failure("Error: index_list must be a non-empty list of row/column numbers.")
        limit = len(table) if dimension == "row" else max((len(r) for r in table), default=0)
        if not all(1 <= i <= limit for i in index_list):
            return failure(f"Error: {dimension} numbers must lie in 1..{limit}.")
        gone = set(index_list)
        if dimension == "row":
            table[:] = [line for r, line in enumerate(table, start=1) if r not in gone]
        else:
            table[:] = [[v for c, v in enumerate(line, start=1) if c not in gone] for line in table]
        return Result(f"Deleted {dimension}(s) {', '.join(map(str, sorted(gone)))}.")

    def tool_sort_sheet_by_col(self, col_num: int, order: str) -> Result:
        table = self._table()
        if isinstance(table, Result):
            return table
        width = max((len(r) for r in table), default=0)
        if not 1 <= col_num <= width:
            return failure(f"Error: col_num must lie in 1..{width}.")
        def key(line: list[Cell]) -> tuple[int, Any]:
            value = line[col_num - 1] if col_num <= len(line) else None
            return (0, value) if isinstance(value, (int, float)) and not isinstance(value, bool) else (1, "" if value is None else str(value))
        table[1:] = sorted(table[1:], key=key, reverse=order == "des")
        return Result(f"Sorted by column {col_num} ({order}).")


def _plain(value: Any) -> Cell:
    """A JSON value as a cell: numbers and text as they are, anything else as its JSON text."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return value
    return json.dumps(value)
