"""Markdown that text from tests, logs, diffs and stores cannot steer.

The Markdown template renders every value as inline text (``escape_text``, applied to each ``{{ }}``
by the environment's ``finalize``) unless a filter here already made it safe: a code span
(``code``, ``code_in_table``), a link target (``link``) or a TOML string in a fenced block
(``toml_string``). One line per value: a value can never start a line, so it can never become a
heading, a list, a quote, a fence or a table row. Rules from CommonMark and GitHub's table extension.
"""

from __future__ import annotations

import json
import re
from urllib.parse import quote


class SafeMarkdown(str):
    """Text a filter here already made safe to place in Markdown as it is."""


_LINE_BREAKS = re.compile(r"[\r\n\x0b\x0c\x85\u2028\u2029]+")
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f]")
# ASCII punctuation that can open or close an inline construct (emphasis, code, links, HTML,
# entities, strikethrough, table cells, a heading's closing sequence) and the backslash itself
_INLINE = re.compile(r"([\\`*_\[\]<>|#~&!])")
# what would open a block if the text started a line: a list item, a numbered item, a thematic break
# or a setext underline (a number such as -0.5 or +64 opens nothing)
_BLOCK_START = re.compile(r"^(?:[-+](?=\s|$)|\d{1,9}[.)](?=\s|$)|[-=\s]+$)")


def one_line(value: object) -> str:
    """``value`` as text on one line: line breaks become a space, other control characters go."""
    return _CONTROL.sub("", _LINE_BREAKS.sub(" ", str(value)))


def escape_text(value: object) -> str:
    """``value`` as inline text that renders as itself (already-safe Markdown passes through)."""
    if isinstance(value, SafeMarkdown):
        return value
    text = _INLINE.sub(r"\\\1", one_line(value))
    if _BLOCK_START.match(text.lstrip()):
        marker = re.search(r"[-+=.)]", text)
        text = text[: marker.start()] + "\\" + text[marker.start() :] if marker else text
    return text


def code(value: object) -> SafeMarkdown:
    """``value`` as one code span, whatever backticks it holds (its fence is longer than any run in it)."""
    text = one_line(value)
    if not text:
        return SafeMarkdown("")
    fence = "`" * (max((len(run) for run in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text[0] in "` " or text[-1] in "` " else ""
    return SafeMarkdown(f"{fence}{pad}{text}{pad}{fence}")


def code_in_table(value: object) -> SafeMarkdown:
    """A code span inside a table cell: GitHub splits cells on ``|`` before it reads code spans."""
    return code(one_line(value).replace("|", "\\|"))


def link(value: object) -> SafeMarkdown:
    """A relative link target: percent-encoded, so no parenthesis, space or angle bracket ends it."""
    return SafeMarkdown(quote(one_line(value), safe="/"))


def toml_string(value: object) -> SafeMarkdown:
    """A TOML basic string on one line (JSON's escapes are TOML's), for a snippet in a fenced block."""
    return SafeMarkdown(json.dumps(one_line(value), ensure_ascii=False))
