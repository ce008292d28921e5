"""The certification's report: each drill's verdict, and the table of the six guarantees.

A guarantee is ``passed`` when every check that speaks for it held, ``FAILED`` when one did
not, and ``not exercised`` when the run had no drill that checks it: a run is a certification
only when all six passed.
"""

from __future__ import annotations

from collections import Counter

import attrs

from tests.certify.harness import Outcome
from tests.history import Verdict

GUARANTEES = {
    1: "no acknowledged write lost",
    2: "3 of 3 healthy after each fault",
    3: "availability recovers after each fault",
    4: "sealed segments byte-identical on every node",
    5: "a bad config crash-loops one node only",
    6: "storage faults only in follower copies",
}
#: A problem tagged with this is the drill's own: it could not do what it had to.
DRILL = 0


@attrs.define
class DrillRecord:
    name: str
    outcome: Outcome

    @property
    def passed(self) -> bool:
        return not self.outcome.problems

    def lines(self) -> list[str]:
        outcome = self.outcome
        errors = ", ".join(f"{reason} {n}" for reason, n in sorted(outcome.errors.items()))
        lines = [f"  errors the load met meanwhile: {errors or 'none'}"]
        for guarantee, text in outcome.problems:
            lines.append(f"  problem ({_tag(guarantee)}): {text}")
        lines.append(f"  verdict: {'passed' if self.passed else 'FAILED'}")
        return lines


def _tag(guarantee: int) -> str:
    return "the drill" if guarantee == DRILL else f"guarantee {guarantee}"


@attrs.define
class Report:
    drills: list[DrillRecord] = attrs.Factory(list)
    #: Guarantee -> (passed, evidence), for the guarantees checked at the end.
    _final: dict[int, tuple[bool, str]] = attrs.Factory(dict)

    def history(self, verdict: Verdict, problems: list[str], follower: str) -> None:
        lost = len(verdict.lost)
        evidence = (
            f"{verdict.acknowledged} acknowledged, {lost} lost, {len(verdict.duplicated)}"
            f" read twice, {verdict.failed} failed produces; {follower}"
        )
        if problems:
            evidence += "; " + "; ".join(problems)
        self._final[1] = (not problems, evidence)

    def copies(self, identical: bool, printed: str, first_look: str | None = None) -> None:
        """The end's ``cluster verify``: whether every sealed copy was identical, what it
        printed, and what its first look found when copies were still being sealed."""
        last = printed.splitlines()[-1] if printed else "no output"
        evidence = last if identical else printed.replace("\n", "; ")
        if first_look is not None:
            evidence += f" (the first look, while segments were being sealed: {first_look})"
        self._final[4] = (identical, f"`cluster verify`: {evidence}")

    def verdicts(self) -> dict[int, tuple[str, str]]:
        """Guarantee -> (verdict, evidence)."""
        found: dict[int, tuple[str, str]] = {}
        for guarantee in GUARANTEES:
            passed, evidence = self._judge(guarantee)
            if passed is None:
                found[guarantee] = ("not exercised", evidence)
            else:
                found[guarantee] = ("passed" if passed else "FAILED", evidence)
        return found

    def _judge(self, guarantee: int) -> tuple[bool | None, str]:
        """Whether ``guarantee`` held (None: not exercised), and the evidence."""
        drills = [drill for drill in self.drills if guarantee in drill.outcome.exercised]
        final = self._final.get(guarantee)
        if not drills and final is None:
            if guarantee in (1, 4):
                return None, "the run did not reach its end"
            return None, "no drill of this run checks it"
        failed = [
            f"{drill.name}: {text}"
            for drill in drills
            for tag, text in drill.outcome.problems
            if tag in (guarantee, DRILL)
        ]
        failing = sum(
            any(tag in (guarantee, DRILL) for tag, _ in drill.outcome.problems) for drill in drills
        )
        parts = []
        if drills:
            parts.append(f"{len(drills) - failing} of {len(drills)} drills")
            slowest = self._slowest(drills, guarantee)
            if slowest:
                parts.append(slowest)
        # A soak runs each kind of drill many times, most finding the same: each finding once.
        notes = Counter(
            drill.outcome.notes[guarantee] for drill in drills if guarantee in drill.outcome.notes
        )
        parts += [note if n == 1 else f"{note} (in {n} drills)" for note, n in notes.items()]
        if final is not None:
            parts.append(final[1])
            if not final[0]:
                failed.append(final[1])
        parts += [problem for problem in failed if problem not in parts]
        return not failed, "; ".join(parts)

    @staticmethod
    def _slowest(drills: list[DrillRecord], guarantee: int) -> str:
        field = {2: "healthy_after", 3: "recovered_after"}.get(guarantee)
        if field is None:
            return ""
        times = [
            (getattr(drill.outcome, field), drill.name)
            for drill in drills
            if getattr(drill.outcome, field) is not None
        ]
        if not times:
            return ""
        seconds, name = max(times)
        return f"slowest {seconds:.1f} s ({name})"

    @property
    def passed(self) -> bool:
        """Whether nothing failed (guarantees not exercised do not fail a run)."""
        drills_ok = all(drill.passed for drill in self.drills)
        return drills_ok and all(v != "FAILED" for v, _ in self.verdicts().values())

    @property
    def certified(self) -> bool:
        return all(v == "passed" for v, _ in self.verdicts().values())

    def table(self) -> list[str]:
        rows = [("", "GUARANTEE", "VERDICT", "EVIDENCE")]
        for guarantee, (verdict, evidence) in self.verdicts().items():
            rows.append((str(guarantee), GUARANTEES[guarantee], verdict, evidence))
        widths = [max(len(row[i]) for row in rows) for i in range(3)]
        lines = [
            "  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True))
            + "  "
            + row[3]
            for row in rows
        ]
        if self.certified:
            lines.append("CERTIFIED: all six guarantees passed")
        elif self.passed:
            missing = [str(g) for g, (v, _) in self.verdicts().items() if v == "not exercised"]
            lines.append(
                f"NOT CERTIFIED: nothing failed, but guarantees {', '.join(missing)} were not"
                " exercised by this run"
            )
        else:
            lines.append("FAILED: see the problems above")
        return lines
