"""What a scenario saw and the invariants it checked: a table, notes and named checks, printed as
text; the scenario fails when any check does."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Report:
    scenario: str
    over: str
    header: list[str] = field(default_factory=list)
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    sections: list[str] = field(default_factory=list)  # lines printed after the table (tables of figures)
    checks: list[tuple[str, bool, str]] = field(default_factory=list)
    seconds: float = 0.0
    #: checks that compare rates measured at different moments: the scenario command judges them
    #: (DESIGN §7), but on a loaded machine they measure the machine as much as the harness
    rate_checks: set[str] = field(default_factory=set)
    started: float = field(default_factory=time.monotonic, repr=False)

    def check(self, name: str, ok: bool, detail: str = "", *, rate: bool = False) -> bool:
        self.checks.append((name, bool(ok), detail))
        if rate:
            self.rate_checks.add(name)
        return bool(ok)

    def check_none(self, name: str, problems: list[str], detail_if_ok: str = "", *, also: bool = True) -> bool:
        """``name`` holds when nothing went wrong (and ``also``); the problems are its detail."""
        return self.check(name, not problems and also, "; ".join(problems) or detail_if_ok)

    def done(self) -> Report:
        self.seconds = time.monotonic() - self.started
        return self

    @property
    def ok(self) -> bool:
        return all(ok for _, ok, _ in self.checks) and bool(self.checks)

    @property
    def failures(self) -> list[str]:
        return [f"{n}: {d}" for n, ok, d in self.checks if not ok]

    @property
    def correctness_failures(self) -> list[str]:
        """Failures of the invariants that do not depend on how fast the machine is right now."""
        return [f"{n}: {d}" for n, ok, d in self.checks if not ok and n not in self.rate_checks]

    def text(self) -> str:
        out = [f"scenario {self.scenario} ({self.over}) — {self.seconds:.1f} s"]
        if self.rows:
            cells = [[_cell(v) for v in r] for r in [self.header] + self.rows]
            widths = [max(len(r[i]) for r in cells) for i in range(len(self.header))]
            for r in cells:
                out.append("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
        out += self.sections
        out += [f"  note: {n}" for n in self.notes]
        for name, ok, detail in self.checks:
            rate = " (rate)" if name in self.rate_checks else ""
            out.append(f"  [{'ok' if ok else 'FAIL'}] {name}{rate}" + (f" — {detail}" if detail else ""))
        out.append(f"  {'PASS' if self.ok else 'FAIL'}: {sum(ok for _, ok, _ in self.checks)}/{len(self.checks)} invariants hold")
        return "\n".join(out)


def _cell(v, width: int = 72) -> str:
    text = str(v)
    return text if len(text) <= width else text[:width - 1] + "…"


@dataclass
class Findings:
    """Table rows and the problems among them, as the case-by-case scenarios (bad input) collect them."""

    rows: list[list] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def add(self, row: list, problem: str | None = None) -> None:
        self.rows.append(row)
        if problem:
            self.problems.append(problem)


def reaped_cells(workers: list[int], left: list[int], shm_left: list[str]) -> list:
    """The table's processes and shared-memory cells after a topology is gone."""
    return [f"{len(workers)} reaped" if not left else f"ALIVE {left}", "clean" if not shm_left else shm_left]


def check_reaped(report: Report, key: str, workers: list[int], left: list[int], shm_left: list[str]) -> None:
    report.check(f"{key}: all processes reaped, shared memory gone", not left and not shm_left and bool(workers),
                 f"{len(workers)} workers" + (f"; alive {left}" if left else "") + (f"; shm {shm_left}" if shm_left else ""))
