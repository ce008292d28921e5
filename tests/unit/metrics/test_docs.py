"""docs/metrics.md documents exactly the series the registry exports, each with its type and,
for a labelled series, its label names."""

from __future__ import annotations

import re
from pathlib import Path

from twisted.internet.task import Clock

from logbroker.metrics import Metrics

DOCS = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"
TABLE_HEADER = re.compile(r"^\| Series \| Type \| Labels \|")
TYPES = {"C": "counter", "G": "gauge", "H": "histogram"}


def documented(text: str) -> dict[str, tuple[str, ...]]:
    """Every series of the ``| Series | Type | Labels | ... |`` tables: its types (one per
    name listed in the row, or one for them all) and the labels named in the row."""
    found: dict[str, tuple[str, ...]] = {}
    in_table = False
    for line in text.splitlines():
        if TABLE_HEADER.match(line):
            in_table = True
        elif not (in_table and line.startswith("|")):
            in_table = False
        elif line.strip("|-") != "":
            series, kinds, labels = (cell.strip() for cell in line.strip("|").split("|")[:3])
            names = re.findall(r"`(svc_\w+)`", series)
            types = [TYPES[kind.strip()] for kind in kinds.split(",")]
            label_names = tuple(re.findall(r"(?:^|; )`(\w+)`", labels))
            for name in names:
                # A row of several types (the process collector's) is checked by name only.
                found[name] = (types[0] if len(types) == 1 else "mixed", *label_names)
    return found


def exported() -> dict[str, tuple[str, ...]]:
    """Every family of a new registry: its documented name (counters with ``_total``), its
    type and its label names."""
    families = {}
    for family in Metrics(Clock()).registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = sorted(
            {
                label
                for sample in family.samples
                for label in sample.labels
                if label not in ("le", "quantile")
            }
        )
        families[name] = (family.type, *labels)
    return families


def test_the_parser_reads_names_types_and_labels() -> None:
    text = (
        "| Series | Type | Labels | Meaning |\n|---|---|---|---|\n"
        "| `svc_a_total` | C | `op`: `x`, `y`; `result`: `ok` | a |\n"
        "| `svc_b`, `svc_c` | G | | b |\n"
    )

    assert documented(text) == {
        "svc_a_total": ("counter", "op", "result"),
        "svc_b": ("gauge",),
        "svc_c": ("gauge",),
    }


def test_every_exported_series_is_documented_and_nothing_else() -> None:
    docs = documented(DOCS.read_text(encoding="utf-8"))
    registry = exported()

    assert sorted(docs) == sorted(registry)
    for name, (kind, *labels) in registry.items():
        if name.startswith("svc_process_"):
            continue  # one row for the process collector's counter and gauges
        assert docs[name][0] == kind, name
        # A labelled series with no sample yet shows no label names; the docs still do.
        assert not labels or tuple(labels) == tuple(sorted(docs[name][1:])), name
