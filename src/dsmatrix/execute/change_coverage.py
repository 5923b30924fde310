"""Changed-line coverage: which lines the change adds or alters ran in the patched build, and under which tests.

The change is a unified diff: the patch's diff for the cell's version, or PR mode's ``git diff base
head``. unidiff parses it; the added lines of ``deepspeed/**.py`` files are the changed lines,
mapped onto the patched wheel's installed files. coverage.py measures every Python process of
the patched build's test runs: the environment has coverage installed (its wheel's ``.pth``
starts measuring in any process that finds ``COVERAGE_PROCESS_START``), ``patch = fork, _exit``
follows pytest-forked children and DeepSpeed's forkserver ranks, ``include`` limits measuring to
the changed files, and dynamic contexts name the test function that ran a line (static context:
``engine`` or ``deepspeed``). A changed line that coverage.py does not count as a statement
(blank, comment, a docstring's continuation) is not counted; every other one must have run.

Branch evidence: coverage.py also measures branches (``branch = true``). Every function the change
touches (its span, decorators included, overlaps a changed or removed line) has its branches
listed, counting only what ran in the tests whose behaviour is compared with stock (the reference
tests): each branch taken there was taken in a scenario where the patched build was shown to do
exactly what stock does. A branch into a ``raise`` that never ran is a guard, not a decision: it
is listed apart ("guards never raised"), not counted.
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unidiff import PatchSet as UnifiedDiff

from dsmatrix.build.patches import PatchSet
from dsmatrix.judge.outcomes import TestOutcome
from dsmatrix.plan.cells import Cell

PACKAGE_PREFIX = "deepspeed/"


@dataclass(frozen=True)
class Hunk:
    file: str  # path in the source tree, e.g. deepspeed/runtime/zero/partitioned_param_coordinator.py
    header: str  # @@ -a,b +c,d @@ section
    added: tuple[int, ...]  # line numbers in the changed file
    texts: Mapping[int, str] = field(default_factory=dict)
    span: tuple[int, int] = (0, 0)  # first and last line of the changed file the hunk adds or removes at


def changed_hunks(diff: str) -> tuple[list[Hunk], list[str]]:
    """The hunks that add lines to DeepSpeed's Python package, and the other changed files (not measured)."""
    hunks, other = [], []
    for patched_file in UnifiedDiff(diff):
        path = patched_file.target_file[2:] if patched_file.target_file.startswith("b/") else patched_file.target_file
        if patched_file.is_removed_file or not (path.startswith(PACKAGE_PREFIX) and path.endswith(".py")):
            other.append(patched_file.path)
            continue
        for hunk in patched_file:
            added = {line.target_line_no: line.value.rstrip("\n") for line in hunk if line.is_added and line.target_line_no}
            header = f"@@ -{hunk.source_start},{hunk.source_length} +{hunk.target_start},{hunk.target_length} @@ {hunk.section_header}"
            hunks.append(Hunk(path, header.strip(), tuple(sorted(added)), added, _changed_span(hunk)))
    return hunks, other


def _changed_span(hunk: object) -> tuple[int, int]:
    """Lines of the changed file where the hunk adds lines or removed some (a removal sits at the
    line that follows it)."""
    at, changed = hunk.target_start, []  # type: ignore[attr-defined]
    for line in hunk:  # type: ignore[attr-defined]
        if line.is_added or line.is_removed:
            changed.append(line.target_line_no if line.is_added else at)
        if not line.is_removed:
            at = (line.target_line_no or at) + 1
    return (min(changed), max(changed)) if changed else (0, 0)


def touched_functions(source: str, spans: Sequence[tuple[int, int]]) -> list[str]:
    """Qualified names (``Class.method``) of the functions whose lines, decorators included, overlap a span."""
    found: list[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                    if any(a <= (child.end_lineno or first) and first <= b for a, b in spans):
                        found.append(name)
                visit(child, name + ".")

    visit(ast.parse(source), "")
    return found


def rcfile(path: Path, data_dir: Path, package_root: Path, files: Sequence[str], context: str) -> Path:
    """A coverage.py config measuring ``files`` (source-tree paths) below ``package_root`` (the
    folder holding the installed ``deepspeed``), one data file per process in ``data_dir``."""
    data_dir.mkdir(parents=True, exist_ok=True)
    include = ",\n    ".join(str(package_root / f) for f in files) or str(package_root / "deepspeed" / "__nothing__")
    path.write_text(
        "[run]\n"
        f"data_file = {data_dir / '.coverage'}\n"
        "parallel = true\n"
        "branch = true\n"
        f"context = {context}\n"
        "dynamic_context = test_function\n"
        "patch = fork, _exit\n"
        f"include =\n    {include}\n"
    )
    return path


def package_root(python: Path) -> Path:
    """The site-packages folder the environment's ``deepspeed`` is installed in."""
    code = "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('deepspeed').origin).parent.parent)"
    proc = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    return Path(proc.stdout.strip())


def measure(data_dir: Path, root: Path, hunks: Sequence[Hunk], other: Sequence[str], compared: Sequence[str] = ()) -> dict[str, object]:
    """Combine the processes' data and judge every changed line: executed or not, and by which tests;
    and the branches of the touched functions taken in ``compared`` (the reference tests' functions)."""
    import coverage  # the suite's own dependency; imported here, as only cells with a change need it

    cov = coverage.Coverage(data_file=str(data_dir / ".coverage"), config_file=False)
    files = sorted(str(p) for p in data_dir.glob(".coverage.*"))
    unreadable = []
    for file in files:  # one at a time: a file coverage.py cannot read is named, not printed as a raw warning
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cov.combine([file], keep=True)
        if caught:  # coverage.py warns only when it cannot read the file
            unreadable.append(Path(file).name)
    data = cov.get_data()
    result_hunks, missing = [], []
    counted = executed = 0
    for hunk in hunks:
        if not hunk.added:
            continue
        path = str(root / hunk.file)
        statements = set(cov.analysis2(path)[1]) if Path(path).is_file() else set()
        ran = set(data.lines(path) or ())
        by_line = data.contexts_by_lineno(path) if ran else {}
        lines = [n for n in hunk.added if n in statements]
        tests = sorted({_test_name(c) for n in lines for c in by_line.get(n, ()) if _test_name(c)})
        hunk_missing = [n for n in lines if n not in ran]
        counted += len(lines)
        executed += len(lines) - len(hunk_missing)
        missing += [{"file": hunk.file, "line": n, "text": hunk.texts.get(n, "").strip()} for n in hunk_missing]
        result_hunks.append(
            {
                "file": hunk.file,
                "header": hunk.header,
                "lines": len(lines),
                "executed": len(lines) - len(hunk_missing),
                "missing": hunk_missing,
                "tests": tests,
            }
        )
    return {
        "changed_lines": counted,
        "executed_lines": executed,
        "missing": missing,
        "hunks": result_hunks,
        "not_measured": sorted(set(other)),
        "processes": len(files) - len(unreadable),
        "unreadable_data_files": unreadable,
        "branches": branch_evidence(cov, data_dir, root, hunks, compared),
    }


def branch_evidence(cov: object, data_dir: Path, root: Path, hunks: Sequence[Hunk], compared: Sequence[str]) -> dict[str, object]:
    """Per touched function, its branches taken and not taken in the tests compared with stock."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for hunk in hunks:
        if hunk.span != (0, 0):
            spans.setdefault(hunk.file, []).append(hunk.span)
    contexts = [rf"\|{re.escape(name)}$" for name in sorted(set(compared))]
    result: dict[str, object] = {
        "compared_tests": sorted(set(compared)), "functions": [], "taken": 0, "total": 0, "not_taken": [], "guards_not_raised": []
    }  # fmt: skip
    if not contexts or not spans:
        return result
    report = data_dir / "branches.json"
    paths = {file: root / file for file in spans if (root / file).is_file()}
    try:
        cov.json_report(outfile=str(report), include=[str(p) for p in paths.values()], contexts=contexts)  # type: ignore[attr-defined]
    except Exception as exc:  # noqa: BLE001 - coverage.py's NoDataError and friends: nothing measured in those tests
        result["error"] = f"{type(exc).__name__}: {exc}"
        return result
    files = {str(Path(name).resolve()): data for name, data in json.loads(report.read_text())["files"].items()}
    functions, not_taken, guards = [], [], []
    for file, path in paths.items():
        source = path.read_text(errors="replace")
        lines = source.splitlines()
        raises = {node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Raise)}
        measured = files.get(str(path.resolve()), {}).get("functions", {})
        for name in touched_functions(source, spans[file]):
            entry = measured.get(name, {})
            taken, missing = entry.get("executed_branches", []), entry.get("missing_branches", [])
            guard = [(a, b) for a, b in missing if b in raises]  # into a `raise`: a guard, not a decision
            decisions = [(a, b) for a, b in missing if b not in raises]
            functions.append({"file": file, "function": name, "taken": len(taken), "total": len(taken) + len(decisions)})
            not_taken += [_branch(file, name, lines, a, b) for a, b in decisions]
            guards += [_branch(file, name, lines, a, b) for a, b in guard]
    all_taken, all_total = sum(f["taken"] for f in functions), sum(f["total"] for f in functions)
    result.update(functions=functions, not_taken=not_taken, guards_not_raised=guards, taken=all_taken, total=all_total)
    return result


def _branch(file: str, function: str, lines: Sequence[str], start: int, end: int) -> dict[str, object]:
    """One branch not taken: from which line (and its text) to which line, or out of the function."""
    text = lines[start - 1].strip() if 0 < start <= len(lines) else ""
    return {"file": file, "function": function, "from": start, "to": end if end > 0 else "exit", "text": text}


def _test_name(context: str) -> str:
    """``engine|TestX.test_y`` as ``engine: TestX.test_y``; the static part alone (import time) is no test."""
    static, _, dynamic = context.partition("|")
    return f"{static}: {dynamic}" if dynamic else ""


def summary_line(measured: Mapping[str, object]) -> str:
    line = f"changed lines executed {measured['executed_lines']}/{measured['changed_lines']}"
    missing = measured.get("missing") or []
    if missing:
        line += "; never executed: " + ", ".join(f"{m['file'].rsplit('/', 1)[-1]}:{m['line']}" for m in missing)  # type: ignore[index]
    branches = measured.get("branches") or {}
    if branches.get("compared_tests"):  # type: ignore[union-attr]
        line += f"; branches of the changed functions taken in tests compared with stock {branches['taken']}/{branches['total']}"  # type: ignore[index]
        never = branches.get("not_taken") or []  # type: ignore[union-attr]
        if never:
            line += " (not taken: " + ", ".join(f"{b['file'].rsplit('/', 1)[-1]}:{b['from']}->{b['to']}" for b in never) + ")"  # type: ignore[index]
        guards = branches.get("guards_not_raised") or []  # type: ignore[union-attr]
        if guards:
            line += f", {len(guards)} guard(s) never raised: " + ", ".join(f"{b['file'].rsplit('/', 1)[-1]}:{b['from']}" for b in guards)  # type: ignore[index]
    unreadable = measured.get("unreadable_data_files") or []
    if unreadable:
        line += f"; {len(unreadable)} process data file(s) unreadable, not counted"  # type: ignore[arg-type]
    return line


def dump(measured: Mapping[str, object], path: Path) -> None:
    path.write_text(json.dumps(measured, indent=2))


@dataclass
class ChangeCoverage:
    """Changed-line coverage of one cell's patched build: the change's hunks, the coverage.py
    configs the patched test runs start with, and the data they leave."""

    hunks: list[Hunk]
    other: list[str]
    root: Path
    data: Path

    @classmethod
    def prepare(cls, cell: Cell, patch: PatchSet, python: Path, run_root: Path) -> ChangeCoverage:
        """The change's hunks, measured in the patched build whose interpreter is ``python``."""
        hunks, other = changed_hunks(patch.diff_for(cell.deepspeed).read_text(errors="replace"))
        data = run_root / "coverage" / cell.id
        shutil.rmtree(data, ignore_errors=True)
        return cls(hunks, other, package_root(python), data)

    def env(self, context: str) -> dict[str, str]:
        """The environment variable that makes every process of a patched test run measure the change."""
        files = sorted({h.file for h in self.hunks})
        return {"COVERAGE_PROCESS_START": str(rcfile(self.data / f"{context}.coveragerc", self.data, self.root, files, context))}

    def measure(self, compared: Mapping[str, TestOutcome]) -> dict[str, Any]:
        """Changed lines and branches; branches count only in the test functions of ``compared``
        (the reference tests, whose patched behaviour was compared with stock's)."""
        functions = [_test_function(test) for test, outcome in compared.items() if outcome.reference == "stock"]
        return measure(self.data, self.root, self.hunks, self.other, functions)


def _test_function(test_id: str) -> str:
    """``module.function`` (coverage.py's test-function context) of ``path/module.py::function[params]@ws1``."""
    module, _, name = test_id.partition("::")
    function = re.split(r"[\[@]", name, maxsplit=1)[0]
    return f"{module.rsplit('/', 1)[-1].removesuffix('.py')}.{function}"
