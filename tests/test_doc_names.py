"""Every ``ddppipe.<module>[.<name>]`` that the code, the rules, the profiles, the docs, the tests
and the benchmarks name exists: a renamed module leaves no stale name behind.

Modules are found by their files under src/ddppipe and names by reading them (AST), so nothing
is imported (no torch).
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from tests.tiny import REPO

SRC = REPO / "src"
NAME = re.compile(r"\bddppipe(?:\.[A-Za-z_]\w*)+(?!\w|\.\.\.)")  # not a cut one: "ddppipe.ta..."
# Where names are written: folders (their text files) and single files.
PLACES = ("src", "workflow", "profiles", "docs", "tests", "bench", "config", "examples",
          "containers", "README.md", "Snakefile", "Makefile", "pyproject.toml")  # fmt: skip
SUFFIXES = {".py", ".smk", ".md", ".yaml", ".yml", ".def", ".toml", ".txt", ".cfg", ".sh"}
# ``ddppipe.X`` that names no module: image labels, MLflow tags, file names, and the old
# module that tasks.loading.MOVED_MODULES names on purpose (to tell a task file where it went).
NOT_CODE = {
    "base", "cuda", "git_commit", "installed", "packages", "requirement", "requirements", "torch",
    "variant",  # image labels (containers/ddppipe.def)
    "role", "sweep",  # MLflow tags (ddppipe.training.tracking.mlflow_log)
    "def", "json", "sif",  # containers/ddppipe.def, ddppipe.json, ddppipe.sif
    "model",  # the pre-0.3 module, named in ddppipe.tasks.loading.MOVED_MODULES
}  # fmt: skip


def module_file(parts: list[str]) -> Path | None:
    """The file of module ``parts`` (``["ddppipe", "slurm", "executor"]``), if any."""
    base = SRC.joinpath(*parts)
    return next((f for f in (base.with_suffix(".py"), base / "__init__.py") if f.is_file()), None)


def defined(body: list[ast.stmt]) -> set[str]:
    """The names a module's (or class's) body defines, imports or assigns."""
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.If | ast.Try):  # `if TYPE_CHECKING:`, `try: ... except`
            names |= defined([*node.body, *getattr(node, "orelse", [])])
    return names


@cache
def names_of(path: Path) -> tuple[set[str], dict[str, set[str]]]:
    """A module's names (with what its ``__getattr__`` serves) and its classes' names."""
    tree = ast.parse(path.read_text())
    names = defined(tree.body)
    classes = {n.name: defined(n.body) for n in tree.body if isinstance(n, ast.ClassDef)}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":  # lazy names
            names.update(c.value for c in ast.walk(node) if isinstance(c, ast.Constant)
                         and isinstance(c.value, str) and c.value.isidentifier())  # fmt: skip
    return names, classes


def resolves(name: str) -> bool:
    """Whether ``ddppipe.a.b.c`` is a module, a name in one, or a name in one's class."""
    parts = name.split(".")
    if parts[1] in NOT_CODE or parts[1].startswith("__"):
        return True
    found = next((i for i in range(len(parts), 0, -1) if module_file(parts[:i])), 1)
    rest = parts[found:]
    if not rest:
        return True
    names, classes = names_of(module_file(parts[:found]))  # type: ignore[arg-type]
    if rest[0] not in names:
        return False
    return len(rest) == 1 or rest[0] not in classes or rest[1] in classes[rest[0]]


def built(path: Path) -> bool:
    """A build's or a tool's output (``src/ddppipe.egg-info``, caches), not written by hand."""
    return any(
        p.startswith(".") or p.endswith(".egg-info") or p == "__pycache__" for p in path.parts
    )


def written_names() -> dict[str, list[str]]:
    """Every ``ddppipe.<dotted>`` in the repository's text files: where each is written."""
    found: dict[str, list[str]] = {}
    for place in PLACES:
        root = REPO / place
        files = [root] if root.is_file() else sorted(root.rglob("*"))
        for path in files:
            if path == Path(__file__) or built(path.relative_to(REPO)):
                continue
            if path.is_file() and (path.suffix in SUFFIXES or path == root):
                for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                    for name in NAME.findall(line):
                        found.setdefault(name, []).append(f"{path.relative_to(REPO)}:{n}")
    return found


def test_every_named_module_exists() -> None:
    written = written_names()
    assert "ddppipe.slurm.executor.status_checks" in written  # the search sees the docs
    stale = {name: where for name, where in written.items() if not resolves(name)}
    assert not stale, "\n".join(f"{n}: {', '.join(w[:3])}" for n, w in sorted(stale.items()))


def test_a_stale_name_is_found() -> None:
    assert resolves("ddppipe.runstate.state.StateDir.checkpoints")
    assert resolves("ddppipe.job") and resolves("ddppipe.slurm.executor.TESTED")
    assert not resolves("ddppipe.cluster.status_checks")  # the package before slurm/
    assert not resolves("ddppipe.runstate.state.of")  # a function that was removed
    assert not resolves("ddppipe.runstate.state.StateDir.nothing")


def test_no_module_name_in_two_packages() -> None:
    """A module's name says its one concern: no two packages have a module of the same name
    (``data/loader.py`` and ``tasks/loader.py`` were one pair; the task's is ``loading.py``)."""
    packages: dict[str, list[str]] = {}
    for path in sorted((SRC / "ddppipe").rglob("*.py")):
        if path.name != "__init__.py":
            packages.setdefault(path.name, []).append(str(path.parent.relative_to(SRC)))
    assert "loader.py" in packages and "loading.py" in packages
    assert {name: found for name, found in packages.items() if len(found) > 1} == {}
