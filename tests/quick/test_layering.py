"""The package's layering, read from its imports: no upward or sideways import, no circle, a judging
layer that launches and writes nothing, and one home for the supervised-process pattern."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "src" / "dsmatrix"

# Each sub-package's rank: a module imports only from its own sub-package or a lower rank
# (docs/how-it-works.md, "Layout"). Equal ranks are siblings and never import each other.
RANK = {"infra": 0, "plan": 1, "judge": 1, "build": 2, "execute": 3, "report": 3, "cli": 4, "__main__": 5}

# What would let a verdict start a process or write a file.
LAUNCHING_MODULES = {"subprocess", "multiprocessing", "concurrent", "asyncio", "pty", "shutil", "docker", "tempfile"}
LAUNCHING_CALLS = {"system", "popen", "fork", "execv", "execve", "spawnv", "kill", "killpg"}
WRITING_CALLS = {"write_text", "write_bytes", "mkdir", "unlink", "rename", "replace", "touch", "rmdir", "dump"}


def modules() -> Iterator[tuple[str, Path]]:
    """Every module of the driver (the payload runs inside cell environments and imports none)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if "payload" in parts:
            continue
        yield ".".join(part for part in parts if part != "__init__"), path


def imports_of(path: Path) -> set[str]:
    """Every module name ``path`` imports, absolute, top level or inside functions."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: relative import"
            names.add(node.module or "")
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def sub_package(module: str) -> str | None:
    """``infra`` for ``dsmatrix.infra.cache``; None for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def internal_graph() -> dict[str, set[str]]:
    """Module → the package's modules it imports (names that are modules, not attributes)."""
    known = {name for name, _ in modules()}
    return {name: {imp for imp in imports_of(path) if imp in known and imp != name} for name, path in modules()}


def test_every_sub_package_has_a_rank() -> None:
    subs = {sub_package(name) for name, _ in modules()} - {None}
    assert subs == set(RANK), f"ranked: {sorted(RANK)}, in the tree: {sorted(subs)}"


def test_no_upward_or_sideways_import() -> None:
    wrong = []
    for module, targets in internal_graph().items():
        here = sub_package(module)
        for target in targets:
            there = sub_package(target)
            if here is None or there is None or here == there:
                continue
            if RANK[there] >= RANK[here]:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the layering:\n" + "\n".join(sorted(wrong))


def test_no_import_circle() -> None:
    graph = internal_graph()
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                cycle = path[path.index(target) :] + [target] if target in path else [module, target]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_judging_layer_launches_and_writes_nothing() -> None:
    found = []
    for module, path in modules():
        if sub_package(module) != "judge":
            continue
        tree = ast.parse(path.read_text())
        for name in imports_of(path):
            if name.startswith("dsmatrix.") and sub_package(name) != "judge":
                found.append(f"{module} imports {name}")
            if name.split(".")[0] in LAUNCHING_MODULES:
                found.append(f"{module} imports {name}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in LAUNCHING_CALLS | WRITING_CALLS:
                found.append(f"{module}:{node.lineno} uses .{node.attr}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
                modes = [arg for arg in node.args[1:2] if isinstance(arg, ast.Constant)]
                modes += [kw.value for kw in node.keywords if kw.arg == "mode" and isinstance(kw.value, ast.Constant)]
                if any(set(str(mode.value)) & set("wax+") for mode in modes):
                    found.append(f"{module}:{node.lineno} opens a file for writing")
    assert not found, "\n".join(found)


def test_one_home_for_the_supervised_process_pattern() -> None:
    """Starting a test, benchmark or leak process, its deadline, stop, shared-memory clean-up and
    log tail live in ``execute.launch``; the process-group primitive in ``infra.processes``; the
    docker daemon is the one other long-lived process."""
    allowed = {
        "Popen": {"dsmatrix.infra.processes", "dsmatrix.infra.docker_engine"},
        "start": {"dsmatrix.infra.processes", "dsmatrix.execute.launch"},
        "remove_shm_buffers": {"dsmatrix.execute.launch"},
        "log_tail": {"dsmatrix.execute.launch"},
    }
    found = []
    for module, path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if name in allowed and module not in allowed[name]:
                # processes.start only: ``.start`` of a thread or a timer is not a process
                owner = node.func.value if isinstance(node.func, ast.Attribute) else None
                if name == "start" and not (isinstance(owner, ast.Name) and owner.id == "processes"):
                    continue
                found.append(f"{module}:{node.lineno} calls {name}")
    assert not found, "the process pattern outside its home:\n" + "\n".join(found)
