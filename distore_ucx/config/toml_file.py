"""Reading distore.toml: every problem reported with its file, line and key.

:func:`load_file` checks every section and key against the settings table
(:mod:`.settings`) and every ``[[tables]]`` entry, and reports each problem
as a :class:`Problem` rather than stopping at the first.
"""

from __future__ import annotations

import difflib
import re
import sys
from dataclasses import dataclass
from typing import Any

from ..table_definition import TableDefinition, TableProblems
from .settings import BY_NAME, SECTIONS, SETTINGS


@dataclass(frozen=True)
class Problem:
    """One thing wrong with the configuration, and where it is."""

    where: str  # "distore.toml:12 [node] arena", "DISTORE_ARENA", "--arena"
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


def _toml_loads(text: str) -> dict:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.10 only
        import tomli as tomllib
    return tomllib.loads(text)


def locate(lines: list[str], section: str, key: str, index: int = 0) -> int | None:
    """Line number (1-based) of `key` in `[section]` (or the index-th `[[section]]`),
    so that a problem names its line; None when it is not there."""
    current, seen = None, -1
    head = re.compile(r"^\s*\[(\[)?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
    assign = re.compile(r"^\s*(\"?)" + re.escape(key) + r"\1\s*=")
    for no, line in enumerate(lines, 1):
        m = head.match(line)
        if m:
            current = m.group(2)
            if current == section and m.group(1):
                seen += 1
            if current == section and not key and (not m.group(1) or seen == index):
                return no
            continue
        if current == section and (not key or assign.match(line)) and seen in (index, -1):
            return no
    return None


def load_file(path: str) -> tuple[dict[str, Any], list[Problem]]:
    """Read and check a distore.toml: ({setting name: value}, problems).

    Every problem is reported with the file, line and key, not only the first.
    """
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        return {}, [Problem(path, f"cannot read the configuration file: {exc.strerror}")]
    try:
        doc = _toml_loads(text)
    except ValueError as exc:
        return {}, [Problem(path, f"not valid TOML: {exc}")]
    lines = text.splitlines()
    values: dict[str, Any] = {}
    problems: list[Problem] = []

    def where(section: str, key: str = "", index: int = 0) -> str:
        line = locate(lines, section, key, index)
        loc = f"{path}:{line}" if line else path
        return f"{loc} [{section}]" + (f" {key}" if key else "")

    for section, body in doc.items():
        if section == "tables":
            if not isinstance(body, list):
                problems.append(Problem(path, "tables must be [[tables]] entries"))
                continue
            good = []
            for i, entry in enumerate(body):
                try:
                    good.append(TableDefinition.from_config(entry))
                except TableProblems as exc:
                    line = locate(lines, "tables", "", i)
                    problems += [Problem(f"{path}:{line or '?'} [[tables]] #{i + 1}", text)
                                 for text in exc.problems]
            names = [t.name for t in good]
            for dup in sorted({n for n in names if names.count(n) > 1}):
                problems.append(Problem(f"{path} [[tables]]", f"two tables named {dup!r}"))
            values["tables"] = tuple(good)
            continue
        if section not in SECTIONS:
            hint = difflib.get_close_matches(section, SECTIONS + ["tables"], n=1)
            problems.append(Problem(
                where(section), "unknown section" + (f"; did you mean [{hint[0]}]?" if hint else
                                                     f" (known: {', '.join(SECTIONS)}, tables)")))
            continue
        if not isinstance(body, dict):
            problems.append(Problem(path, f"{section} must be a [{section}] section"))
            continue
        keys = [s.key for s in SETTINGS if s.section == section]
        for key, raw in body.items():
            setting = BY_NAME.get(f"{section}.{key}")
            if setting is None:
                hint = difflib.get_close_matches(key, keys, n=1)
                text = f"; did you mean {hint[0]!r}?" if hint else f" (known: {', '.join(keys)})"
                problems.append(Problem(where(section, key), "unknown key" + text))
                continue
            try:
                values[setting.name] = setting.parse(raw)
            except ValueError as exc:
                problems.append(Problem(where(section, key), str(exc)))
    return values, problems
