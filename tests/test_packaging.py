"""What pyproject.toml declares. Every third-party package that tuner/, api/ and trainer/ import is
declared, in the core dependencies or in the extra of the code that imports it, so `pip install
parallel-tuner` (or `[api]`, `[worker]`, `[trainer]`) gives each command what it imports. Found by
reading each module's imports (a function's lazy imports too), not by running them: a missing
package shows only on the path that imports it (`tuner trials --csv` without pandas ended in a
traceback). And every declared floor is in constraints/floors.txt, which `make check-floors`
installs (scripts/check-floors.sh, docs/dependencies.md)."""

from __future__ import annotations

import ast
import sys
import tomllib
from collections.abc import Iterator
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
FIRST_PARTY = ("trainer", "tuner", "api")
# Import name -> distribution, where they differ.
DISTRIBUTION = {
    "yaml": "pyyaml",
    "pydantic_settings": "pydantic-settings",
    "prometheus_client": "prometheus-client",
}
# The extra a package's code may use besides the core dependencies: the API (`tuner serve`, the
# dashboard) and the bundled trainer (torch).
EXTRA = {"api/": "api", "trainer/": "trainer"}
# tuner/ is imported by the core CLI, so it uses the core only, but for what only a worker running a
# study imports, inside a function: the external samplers' libraries and the calibration's fit.
WORKER_ONLY = {"optuna", "deephyper", "scipy"}


def _declared() -> dict[str, set[str]]:
    """{"core" or an extra: canonical distribution names}; the `all` extra's self-reference is left out."""
    groups = {"core": PYPROJECT["dependencies"], **PYPROJECT["optional-dependencies"]}
    return {
        group: {canonicalize_name(Requirement(r).name) for r in reqs} - {"parallel-tuner"}
        for group, reqs in groups.items()
    }


def _third_party_imports(path: Path) -> Iterator[tuple[int, str, bool]]:
    """(line, top-level name, inside a function) of every absolute import of another project's
    package in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    lazy = {id(n) for f in functions for n in ast.walk(f)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top not in sys.stdlib_module_names and top not in FIRST_PARTY and top != "__future__":
                yield node.lineno, top, id(node) in lazy


def _imports() -> dict[tuple[str, int], tuple[str, bool]]:
    """{(file relative to the root, line): (distribution, inside a function)} over every module of
    the three packages."""
    found = {}
    for package in FIRST_PARTY:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            for line, top, lazy in _third_party_imports(path):
                found[relative, line] = (canonicalize_name(DISTRIBUTION.get(top, top)), lazy)
    return found


def test_every_third_party_import_is_declared_for_the_code_that_imports_it() -> None:
    """...and in tuner/ a package of the worker extra only inside a function (WORKER_ONLY)."""
    declared = _declared()
    undeclared = []
    for (relative, line), (dist, lazy) in sorted(_imports().items()):
        extra = next((e for prefix, e in EXTRA.items() if relative.startswith(prefix)), None)
        if relative.startswith("tuner/") and lazy and dist in WORKER_ONLY:
            extra = "worker"
        if dist not in declared["core"] | (declared[extra] if extra else set()):
            where = f"the core dependencies or the {extra!r} extra" if extra else "the core dependencies"
            undeclared.append(f"{relative}:{line} imports {dist}, which is not in {where}")
    assert not undeclared, "\n".join(undeclared)


def test_the_scan_sees_each_group_and_the_names_map_to_their_distributions() -> None:
    """The scan is not vacuous (it finds what each group is for), and each import name maps to the
    distribution that installs it here (importlib.metadata), so the mapping cannot drift."""
    found = {dist for dist, _ in _imports().values()}
    assert {"typer", "sqlalchemy", "pyyaml", "pandas", "fastapi", "starlette", "torch", "optuna"} <= found
    installed = packages_distributions()
    for name, dist in DISTRIBUTION.items():
        assert dist in {canonicalize_name(d) for d in installed.get(name, [])}, (name, installed.get(name))
    assert {*EXTRA.values(), "worker"} <= set(_declared()), "an extra named here is not in pyproject.toml"
    assert found >= WORKER_ONLY, "a WORKER_ONLY package tuner/ no longer imports"


def test_every_declared_floor_is_pinned_in_constraints_floors() -> None:
    """constraints/floors.txt pins each declared requirement at its bound (or, where the bound names
    no patch release, a first release under it: 1.11 -> 1.11.1), so `make check-floors` installs every
    floor; scripts/check-floors.sh applies the same rule to what it installed."""
    floors = {}
    for line in (ROOT / "constraints" / "floors.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, pin = line.split("==")
            floors[canonicalize_name(name)] = Version(pin)
    groups = [PYPROJECT["dependencies"], *PYPROJECT["optional-dependencies"].values()]
    wrong = []
    for req in (Requirement(r) for reqs in groups for r in reqs):
        name = canonicalize_name(req.name)
        if name == "parallel-tuner":
            continue
        bound = next(Version(s.version) for s in req.specifier if s.operator in (">=", "=="))
        pin = floors.get(name)
        if pin is None or pin < bound or pin.release[: len(bound.release)] != bound.release:
            wrong.append(f"{req}: constraints/floors.txt pins {pin}")
    assert not wrong, "\n".join(wrong)
