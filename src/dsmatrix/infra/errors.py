"""One-line fatal errors, each naming what went wrong and where (cibuildwheel style).

The CLI prints ``dsmatrix: error: <message>`` (a line each, for several) and exits with the class's
code; no traceback.
Codes: 1 a cell failed (CellError), 2 bad matrix or selection, 3 host (docker, emulation),
4 unknown version, 5 missing interpreter, 6 patch set, 7 patch does not apply, 8 disk,
9 results file, 130 interrupted.
Errors raised while setting up or running one cell are caught and recorded as that cell's
``error`` verdict instead.
"""

from __future__ import annotations


class FatalError(Exception):
    """Base class: a problem the user must fix before the run can go on."""

    exit_code = 2


class ConfigError(FatalError):
    """Malformed matrix file or command-line selection."""

    exit_code = 2


class UnknownVersionError(FatalError):
    """A Python, torch or DeepSpeed version that cannot be found or installed."""

    exit_code = 4


class InterpreterNotFound(UnknownVersionError):
    """No local interpreter for a Python version of the matrix (never downloaded)."""

    exit_code = 5


class PatchError(FatalError):
    """No diff covers a DeepSpeed version, or the patch set itself is malformed."""

    exit_code = 6


class PatchDoesNotApply(PatchError):
    """A diff's hunk does not apply to a DeepSpeed release's source."""

    exit_code = 7


class DiskSpaceError(FatalError):
    """The selected cells would not fit the free disk."""

    exit_code = 8


class ResultsError(FatalError):
    """A results file that is truncated, unreadable or not a dsmatrix result."""

    exit_code = 9


class CellError(FatalError):
    """Set-up or run failure inside one cell; recorded as the cell's ``error`` verdict."""

    exit_code = 1


class InstallError(CellError):
    """Creating a cell environment or installing into it failed."""


class BuildError(CellError):
    """Building a DeepSpeed wheel failed."""


class RunError(CellError):
    """The engine tests could not run to completion (crash, timeout, no tests)."""


class HostError(FatalError):
    """A host (docker engine, emulation, container image) the selection needs is not available."""

    exit_code = 3


class MissingPrerequisites(HostError):
    """A tool or file this machine must have is missing: one line each, with how to get it."""

    def __init__(self, missing: list[str]) -> None:
        super().__init__("\n".join(missing))


class DockerUnavailable(HostError):
    """No docker engine answers, and none could be installed or started."""


class EmulationUnavailable(HostError):
    """This kernel cannot run the platform's binaries (no binfmt_misc / qemu-user entry)."""


class ImageBuildError(HostError):
    """Building a base or suite image failed."""
