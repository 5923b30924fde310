"""Evidence that names no machine: before a run keeps a record, a JUnit file or a log, the absolute
paths of the machine that made it (the run's folders, the working folder, the cache, the home and
temporary folders, the interpreter) become placeholders such as ``<run>`` or ``~``, and its host
name, where JUnit and pytest-benchmark record it, ``runner``."""

from __future__ import annotations

import re
import socket
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

Roots = list[tuple[re.Pattern[str], str]]


def machine_roots(named: Mapping[Path, str]) -> Roots:
    """The folders to hide, ``named`` first (e.g. the run's own as ``<run>``), then the working
    folder, home, temporary folder and interpreter prefixes; each as written and resolved, the
    longest first, matched only as a whole path component."""
    folders = {**named, Path.cwd(): "<cwd>", Path(tempfile.gettempdir()): "<tmp>", Path.home(): "~"}
    folders.setdefault(Path(sys.prefix), "<python>")
    folders.setdefault(Path(sys.base_prefix), "<python>")
    spelled: dict[str, str] = {}
    for folder, name in folders.items():
        for form in (str(folder.absolute()), str(folder.resolve())):  # never a relative name: it would match words
            if form != "/" and form not in spelled:
                spelled[form] = name
    ordered = sorted(spelled.items(), key=lambda item: -len(item[0]))
    roots = [(re.compile(re.escape(form) + r"(?![\w.+-])"), name) for form, name in ordered]
    host = re.escape(socket.gethostname())  # as JUnit (hostname=) and pytest-benchmark ("node":) record it
    return [*roots, (re.compile(f'hostname="{host}"'), 'hostname="runner"'), (re.compile(f'"node": "{host}"'), '"node": "runner"')]


def portable_text(text: str, roots: Roots) -> str:
    for pattern, name in roots:
        text = pattern.sub(name, text)
    return text


def portable_record(data: Any, roots: Roots) -> Any:
    """``data`` (a JSON record) with every string made portable."""
    if isinstance(data, str):
        return portable_text(data, roots)
    if isinstance(data, dict):
        return {key: portable_record(value, roots) for key, value in data.items()}
    if isinstance(data, list):
        return [portable_record(value, roots) for value in data]
    return data


TEXT_FILES = (".xml", ".log", ".json", ".txt")  # never a binary file (coverage's SQLite data): a rewrite would corrupt it


def make_files_portable(paths: list[Path], roots: Roots) -> None:
    """Rewrite text files in place (JUnit XML, logs, JSON); a file that does not change, or is not one
    of ``TEXT_FILES``, is left alone."""
    for path in paths:
        if path.suffix not in TEXT_FILES:
            continue
        try:
            text = path.read_text(errors="surrogateescape")
        except OSError:
            continue
        made = portable_text(text, roots)
        if made != text:
            path.write_text(made, errors="surrogateescape")
