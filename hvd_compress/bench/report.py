"""What both benchmarks do with their rows: print a table, check targets, write JSON."""

from __future__ import annotations

import json
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

Row = dict[str, Any]

_OPS: dict[str, Callable[[float, float], bool]] = {">=": operator.ge, "<=": operator.le,
                                                "==": operator.eq}


@dataclass(frozen=True)
class Column:
    """A table column: its header and how to render a row's cell."""

    header: str
    cell: Callable[[Row], str]


def field(key: str, fmt: str = "{}") -> Callable[[Row], str]:
    """A cell showing one row field, formatted with ``fmt``."""
    return lambda row: fmt.format(row[key])


def optional_field(key: str, fmt: str) -> Callable[[Row], str]:
    """Like :func:`field`, but ``-`` where the field is ``None`` or absent (not measured:
    ``bench ps`` counts a server process's page faults over gRPC only, say)."""
    return lambda row: "-" if row.get(key) is None else fmt.format(row[key])


@dataclass(frozen=True)
class Target:
    """A goal for one metric of the rows matching ``where``; reported, never enforced."""

    where: Mapping[str, Any]
    metric: str
    op: str
    value: float

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise ValueError(f"target operator must be one of {list(_OPS)}, got {self.op!r}")

    def matches(self, row: Row) -> bool:
        return all(row.get(key) == want for key, want in self.where.items())

    def met(self, row: Row) -> bool:
        """Whether the row meets it; a metric that was not measured (``None``) does not."""
        return row[self.metric] is not None and _OPS[self.op](row[self.metric], self.value)

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.value:g}"


def format_table(rows: Sequence[Row], columns: Sequence[Column]) -> str:
    """Rows as a plain-text table, one line per row, columns padded to their widest cell."""
    cells = [[c.header for c in columns]]
    cells += [[c.cell(row) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown_table(rows: Sequence[Row], columns: Sequence[Column]) -> str:
    """Rows as a GitHub-flavoured Markdown table (``|`` in a cell escaped)."""
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"

    return "\n".join([line([c.header for c in columns]), line(["---"] * len(columns)),
                      *(line([c.cell(row) for c in columns]) for row in rows)])


def _figure(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.4g}"


def check_targets(rows: Sequence[Row], targets: Sequence[Target]) -> list[str]:
    """One PASS/FAIL line per (target, matching row); the rows gain ``target`` and
    ``target_met``. Targets no row matches (sizes or layer sets not run) are skipped."""
    lines = []
    for target in targets:
        for row in filter(target.matches, rows):
            met = target.met(row)
            row["target"], row["target_met"] = str(target), met
            where = ", ".join(f"{k}={v}" for k, v in target.where.items())
            lines.append(f"{'PASS' if met else 'FAIL'}  {where}: "
                         f"{target.metric} = {_figure(row[target.metric])}, target {target}")
    return lines


def publish(title: str, rows: list[Row], columns: Sequence[Column],
            targets: Sequence[Target], json_path: Path | None) -> None:
    """Print the table and the target lines; write the rows to ``json_path`` if given."""
    print(title)
    print(format_table(rows, columns))
    lines = check_targets(rows, targets)
    if lines:
        print("\nTargets:")
        print("\n".join(lines))
    if json_path is not None:
        json_path.write_text(json.dumps(rows, indent=2) + "\n")
        print(f"\nwrote {len(rows)} rows to {json_path}")
