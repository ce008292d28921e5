"""docs/configuration.md lists exactly the variables the broker knows, as the registry has them,
and the twistd flags with the variables they override."""

from __future__ import annotations

import re
from pathlib import Path

from logbroker.config import VARIABLES, Variable
from logbroker.tap import FLAG_VARIABLES

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
TABLE_HEADER = "| Variable | Default | Meaning |"


def documented_variables(text: str) -> list[Variable]:
    """The rows of every Variable | Default | Meaning table, under the ``##`` heading above it."""
    variables = []
    section = ""
    in_table = False
    for line in text.splitlines():
        if line.startswith("## "):
            section = line.removeprefix("## ").strip()
        if line == TABLE_HEADER:
            in_table = True
        elif not (in_table and line.startswith("|")):
            in_table = False
        elif line.strip("|-") != "":
            name, default, meaning = (cell.strip() for cell in line.strip("|").split("|"))
            variables.append(Variable(section, name.strip("`"), default, meaning))
    return variables


def test_the_parser_reads_sections_and_rows() -> None:
    text = "## One\n\nprose\n\n| Variable | Default | Meaning |\n|---|---|---|\n"
    text += "| `SVC_A` | 1 | a |\n| `SVC_B` | unset | b, `c` |\n\n| Flag | Variable |\n"
    text += "|---|---|\n| `--a` | `SVC_A` |\n## Two\n| Variable | Default | Meaning |\n"
    text += "|---|---|---|\n| `SVC_C` | x | c |\n"

    assert documented_variables(text) == [
        Variable("One", "SVC_A", "1", "a"),
        Variable("One", "SVC_B", "unset", "b, `c`"),
        Variable("Two", "SVC_C", "x", "c"),
    ]


def test_the_docs_list_every_variable_with_its_section_default_and_meaning() -> None:
    assert documented_variables(DOCS.read_text(encoding="utf-8")) == list(VARIABLES)


def test_the_docs_list_every_flag_with_its_variable() -> None:
    rows = re.findall(
        r"^  \| `--([a-z-]+)[^|]*\| `(\w+)` \|$", DOCS.read_text(encoding="utf-8"), re.MULTILINE
    )

    assert dict(rows) == FLAG_VARIABLES
