"""Test outcomes: read from pytest's JUnit XML, merged over ranks, stored and read back.

Reads files; launches nothing and writes nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from junitparser import Error, Failure, JUnitXml, Properties, Skipped

PYTEST_OK = (0, 1)  # all passed / some failed: both are results


@dataclass(frozen=True)
class TestOutcome:
    __test__ = False  # not a pytest test class

    outcome: str  # passed | failed | error | skipped
    bug: str = ""  # non-empty for bug tests: lifecycle | retrace | recompute
    message: str = ""
    duration_s: float = 0.0
    properties: Mapping[str, str] = field(default_factory=dict)
    observed: str = ""  # a bug test's figures when it saw the bug (the only evidence that counts)
    reference: str = ""  # the build whose recorded behaviour this test's must equal (``stock``)


@dataclass(frozen=True)
class TestRun:
    __test__ = False  # not a pytest test class

    outcomes: Mapping[str, TestOutcome]
    duration_s: float
    junits: tuple[Path, ...]
    logs: tuple[Path, ...]


def outcomes_from_junits(junits: Sequence[Path]) -> dict[str, TestOutcome]:
    """The merged outcomes (``@ws<N>`` ids) of JUnit files named ``<name>-ws<N>-rank<R>.xml``."""
    by_size: dict[int, list[Path]] = {}
    for junit in sorted(junits):
        size = int(junit.stem.rsplit("-ws", 1)[1].split("-rank", 1)[0])
        by_size.setdefault(size, []).append(junit)
    outcomes: dict[str, TestOutcome] = {}
    for size, files in sorted(by_size.items()):
        merged = merge_ranks([read_junit(f) for f in files])
        outcomes.update({f"{test_id}@ws{size}": outcome for test_id, outcome in merged.items()})
    return outcomes


SEVERITY = {"error": 3, "failed": 2, "passed": 1, "skipped": 0}


def merge_ranks(per_rank: Sequence[Mapping[str, TestOutcome]]) -> dict[str, TestOutcome]:
    """One outcome per test over all ranks: the worst one, with the rank that saw it.

    A test skipped on some ranks and run on others, or missing on a rank, is an error.
    """
    if len(per_rank) == 1:
        return dict(per_rank[0])
    merged: dict[str, TestOutcome] = {}
    for test_id in sorted(set().union(*per_rank)):
        found = [(rank, outcomes.get(test_id)) for rank, outcomes in enumerate(per_rank)]
        missing = [rank for rank, o in found if o is None]
        present = [(rank, o) for rank, o in found if o is not None]
        bug = present[0][1].bug
        if missing:
            merged[test_id] = TestOutcome("error", bug, f"not run on rank(s) {missing}")
            continue
        skipped = {o.outcome == "skipped" for _, o in present}
        if len(skipped) > 1:
            merged[test_id] = TestOutcome(
                "error", bug, "skipped on some ranks only: " + ", ".join(f"rank {r} {o.outcome}" for r, o in present)
            )
            continue
        rank, worst = max(present, key=lambda item: SEVERITY[item[1].outcome])
        message = f"rank {rank}: {worst.message}" if worst.message and worst.outcome != "skipped" else worst.message
        properties = {f"rank{r}.{k}": v for r, o in present for k, v in o.properties.items()}
        duration = max(o.duration_s for _, o in present)
        # evidence only when every rank that failed failed by seeing the bug
        failing = [(r, o) for r, o in present if o.outcome in ("failed", "error")]
        seen = bool(failing) and all(o.observed for _, o in failing)
        observed = "; ".join(f"rank {r}: {o.observed}" for r, o in failing) if seen else ""
        merged[test_id] = TestOutcome(worst.outcome, bug, message, duration, properties, observed, present[0][1].reference)
    return merged


def read_junit(path: Path, full_ids: bool = False) -> dict[str, TestOutcome]:
    """Outcome per test id (``file::name[params]``; ``full_ids``: ``dotted.module.Class::name[params]``)
    from a pytest JUnit XML file."""
    outcomes: dict[str, TestOutcome] = {}
    for suite in JUnitXml.fromfile(str(path)):
        for case in suite:
            test_file = (case.classname if full_ids else case.classname.rsplit(".", 1)[-1]) if case.classname else "?"
            test_id = f"{test_file}::{case.name}"
            found = case.child(Properties)
            properties = {p.name: p.value for p in found} if found is not None else {}
            outcome, message = "passed", ""
            for result in case.result:
                if isinstance(result, Skipped):
                    outcome, message = "skipped", result.message or ""
                elif isinstance(result, Error):
                    outcome, message = "error", result.message or ""
                elif isinstance(result, Failure):
                    outcome, message = "failed", result.message or ""
            outcomes[test_id] = TestOutcome(
                outcome=outcome,
                bug=properties.pop("bug", ""),
                message=_one_line(message),
                duration_s=round(float(case.time or 0.0), 3),
                properties=properties,
                observed=properties.pop("bug_observed", ""),
                reference=properties.pop("reference", ""),
            )
    return outcomes


def _one_line(message: str, limit: int = 600) -> str:
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def outcome_dict(outcome: TestOutcome) -> dict[str, object]:
    data: dict[str, object] = {"outcome": outcome.outcome, "duration_s": outcome.duration_s}
    if outcome.bug:
        data["bug"] = outcome.bug
    if outcome.message:
        data["message"] = outcome.message
    if outcome.observed:
        data["bug_observed"] = _maybe_json(outcome.observed)
    if outcome.reference:
        data["reference"] = outcome.reference
    if outcome.properties:
        data["properties"] = {k: _maybe_json(v) for k, v in outcome.properties.items()}
    return data


def outcome_from_dict(data: Mapping[str, object] | None) -> TestOutcome | None:
    """The inverse of ``outcome_dict`` (a stored result read back); None for a test a build did not run."""
    if not data:
        return None
    observed = data.get("bug_observed")
    properties = data.get("properties") or {}
    return TestOutcome(
        outcome=str(data.get("outcome", "error")),
        bug=str(data.get("bug", "")),
        message=str(data.get("message", "")),
        duration_s=float(data.get("duration_s", 0.0)),  # type: ignore[arg-type]
        properties={k: v if isinstance(v, str) else json.dumps(v) for k, v in properties.items()},  # type: ignore[union-attr]
        observed="" if observed is None else observed if isinstance(observed, str) else json.dumps(observed),
        reference=str(data.get("reference", "")),
    )


def _maybe_json(value: str) -> object:
    try:
        return json.loads(value)
    except (TypeError, ValueError):
        return value
