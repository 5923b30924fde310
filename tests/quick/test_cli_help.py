"""The command line follows conventions: every option has help and shows its default, the
epilog lists exit codes and environment variables, ``bench`` is ``matrix --bench``, and
``--cell`` takes what ``--plan`` prints."""

from __future__ import annotations

import argparse
import json

import pytest
from helpers import REPO, run_cli

from dsmatrix.cli import build_parser, parse_args
from dsmatrix.infra import errors


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


@pytest.mark.parametrize("command", ["matrix", "bench", "report", "images"])
def test_every_option_has_help_and_its_default(command: str) -> None:
    sub = subparsers()[command]
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{command} {action.option_strings or action.dest}: no help"
    text = " ".join(sub.format_help().split())
    assert "130 interrupted" in text and "9 a results file" in text
    for needle in {"matrix": ["(default: 0.035)", "(default: results)", "git:URL_OR_PATH@REF", "DSMATRIX_TORCH_CPU_INDEX"],
                   "bench": ["(default: on)", "PIP_FIND_LINKS"], "report": ["(default: reports)"],
                   "images": ["(default: ~/.cache/dsmatrix)"]}[command]:  # fmt: skip
        assert needle in text, (command, needle)


def test_the_epilog_names_every_exit_code_the_errors_use() -> None:
    text = subparsers()["matrix"].format_help()
    codes = {cls.exit_code for cls in vars(errors).values() if isinstance(cls, type) and issubclass(cls, errors.FatalError)}
    for code in sorted(codes | {0, 1, 130}):
        assert f"\n  {code:<4} " in text, code


def test_bench_is_matrix_with_benchmarks() -> None:
    bench, matrix = parse_args(["bench", "--tier", "smoke"]), parse_args(["matrix", "--tier", "smoke"])
    assert (bench.command, bench.bench, matrix.bench) == ("bench", True, None)
    assert {k: v for k, v in vars(bench).items() if k not in ("command", "bench")} == {
        k: v for k, v in vars(matrix).items() if k not in ("command", "bench")
    }


def test_the_cell_option_takes_what_the_plan_prints() -> None:
    plan = run_cli("matrix", "--plan", cwd=REPO, timeout=120)
    labels = [line for line in plan.stdout.splitlines() if line.startswith("matrix(")]
    assert len(labels) == 2
    proc = run_cli("matrix", "--plan", "--json", "--cell", labels[1], cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [c["label"] for c in json.loads(proc.stdout)["include"]] == [labels[1]]
