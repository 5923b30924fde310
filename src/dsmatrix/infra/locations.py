"""Where the suite's files come from, however ``dsmatrix`` is installed.

The payload a build's environment runs (engine tests, benchmark scripts, the choice of DeepSpeed's
own tests) lives in the package itself, ``dsmatrix/payload/``. The project's files (matrix,
patches, Dockerfiles) live in the repository's ``matrix/``, ``patches/`` and ``containers/``
folders and ship in the wheel as ``dsmatrix.bundled.*`` (pyproject.toml maps the folders). Run from
a checkout (source tree or editable install) they are read from the checkout; installed, from the
package. A *project root* is a folder with ``matrix/matrix.toml`` (``--root``, or found from the
working directory upwards): its matrix file and patches are the defaults when there is one.
"""

from __future__ import annotations

import importlib.util
import tomllib
from functools import cache
from pathlib import Path

from dsmatrix.infra.errors import ConfigError

PACKAGE = Path(__file__).resolve().parents[1]
PAYLOAD = ("engine", "bench", "deepspeed_tests")  # folders of ``dsmatrix/payload``
SUITE_FOLDERS = {"matrix": "matrix", "patches": "patches", "containers": "containers"}
MATRIX_FILE = Path("matrix") / "matrix.toml"
PATCH = Path("patches") / "zero3-release-cache"


def _is_suite_checkout(path: Path) -> bool:
    """``path`` is a source tree of this suite: pyproject.toml naming dsmatrix, src/dsmatrix, a noxfile."""
    pyproject = path / "pyproject.toml"
    if not (pyproject.is_file() and (path / "src" / "dsmatrix").is_dir() and (path / "noxfile.py").is_file()):
        return False
    try:
        return tomllib.loads(pyproject.read_text()).get("project", {}).get("name") == "dsmatrix"
    except (OSError, tomllib.TOMLDecodeError):
        return False


@cache
def source_checkout() -> Path | None:
    """The checkout this package is imported from (source tree or editable install), or None when installed."""
    candidate = PACKAGE.parents[1]
    return candidate if _is_suite_checkout(candidate) else None


def suite_path(name: str) -> Path:
    """The folder of one kind of the suite's own files (one of ``PAYLOAD`` or a key of ``SUITE_FOLDERS``)."""
    if name in PAYLOAD:
        return PACKAGE / "payload" / name
    checkout = source_checkout()
    if checkout is not None:
        return checkout / SUITE_FOLDERS[name]
    spec = importlib.util.find_spec(f"dsmatrix.bundled.{name}")
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise ConfigError(f"dsmatrix.bundled.{name}: the installed package lacks its {SUITE_FOLDERS[name]}/ files (a broken wheel?)")
    return Path(locations[0])


def project_root(explicit: Path | None = None, start: Path | None = None) -> Path | None:
    """``--root`` if given (it must hold matrix/matrix.toml), else the nearest folder from ``start``
    (the working directory) upwards that holds one, else None."""
    if explicit is not None:
        root = explicit.expanduser().resolve()
        if not (root / MATRIX_FILE).is_file():
            raise ConfigError(f"{root}: --root is not a project root (no {MATRIX_FILE})")
        return root
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / MATRIX_FILE).is_file():
            return folder
    return None


def default_matrix(root: Path | None) -> Path:
    """The project's matrix file, or the bundled one."""
    return root / MATRIX_FILE if root is not None else suite_path("matrix") / MATRIX_FILE.name


def default_patch(root: Path | None) -> Path:
    """The project's fix (patches/zero3-release-cache), or the bundled one."""
    if root is not None and (root / PATCH).exists():
        return root / PATCH
    return suite_path("patches") / PATCH.name


def image_source_tree(root: Path | None) -> Path:
    """The suite's source tree a container runs ``nox -s matrix`` from: this package's checkout, or
    the project root when it is a checkout of the suite."""
    for candidate in (source_checkout(), root):
        if candidate is not None and _is_suite_checkout(candidate):
            return candidate
    raise ConfigError("cells in an image run the suite from its source tree: run dsmatrix from a checkout of it or pass --root CHECKOUT")
