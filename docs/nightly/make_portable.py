"""Make results stores written before the suite kept evidence portable (issue 36) as a run writes
them now: records, summaries, JUnit files, logs and pytest-benchmark JSON with the machine's folders
as placeholders, the patch named by its name. ``CHECKOUT`` is the folder the run was started in.

    python docs/nightly/make_portable.py CHECKOUT RUN_FOLDER...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dsmatrix.infra.portable import machine_roots, make_files_portable, portable_record
from dsmatrix.infra.results import load_run


def make_run_portable(run: Path, checkout: Path) -> None:
    roots = machine_roots({run: "<run>", run.parent: "<results>", checkout: "<cwd>"})
    for record in [run / "summary.json", *sorted((run / "cells").glob("*.json"))]:
        data = portable_record(json.loads(record.read_text()), roots)
        if "patch" in data:
            data["patch"]["source"] = Path(data["patch"]["source"]).name
        record.write_text(json.dumps(data, indent=2) + "\n")
    make_files_portable([p for folder in ("raw", "bench") for p in sorted((run / folder).glob("*")) if p.is_file()], roots)
    load_run(run)  # and still a store the suite reads


if __name__ == "__main__":
    for folder in sys.argv[2:]:
        make_run_portable(Path(folder).absolute(), Path(sys.argv[1]))
        print(f"{folder}: portable")
