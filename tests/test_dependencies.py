"""Every third-party package the tests import is declared in pyproject.toml, among gpush's own
dependencies or its ``test`` extras: ``make test`` installs ``.[test]`` on a fresh machine, and a
package that arrives only as some other package's dependency can go away with it."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections.abc import Iterable
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {"broker", "adapters", "migrations", "policies", "tests", "integration", "conftest"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_distributions(pyproject: Path) -> set[str]:
    """The names of what pyproject.toml installs for the tests: dependencies and the test extras."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    return {normalized(re.match(r"[A-Za-z0-9._-]+", r.strip()).group(0)) for r in requirements}


def imported_modules(path: Path) -> set[str]:
    """The top-level modules a file imports, anywhere in it (``pytest.importorskip`` too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "importorskip"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.add(node.args[0].value)
    return {name.split(".")[0] for name in names}


def undeclared_imports(files: Iterable[Path], declared: set[str]) -> list[str]:
    """``file: module`` for each third-party module a file imports whose distribution is not declared."""
    installed = packages_distributions()
    found = []
    for path in files:
        for module in sorted(imported_modules(path)):
            if module in sys.stdlib_module_names or module in FIRST_PARTY:
                continue
            if (path.parent / f"{module}.py").is_file() or (path.parent / module).is_dir():
                continue  # a script's sibling (integration/bench/scratch.py)
            distributions = installed.get(module, [])
            if not any(normalized(d) in declared for d in distributions):
                where = ", ".join(distributions) or "not installed"
                found.append(f"{path.relative_to(ROOT)}: {module} ({where})")
    return found


def test_every_package_the_tests_import_is_declared_in_pyproject() -> None:
    files = [
        ROOT / "conftest.py",
        *sorted((ROOT / "tests").rglob("*.py")),
        *sorted((ROOT / "integration").rglob("*.py")),
    ]
    missing = undeclared_imports(files, declared_distributions(ROOT / "pyproject.toml"))
    assert missing == [], "declare these in pyproject.toml's test extras:\n" + "\n".join(missing)


def test_an_import_of_an_undeclared_package_is_named(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "helper.py").write_text("")
    test_file = tmp_path / "test_sample.py"
    test_file.write_text(
        "import json\nimport helper\nimport yaml\nfrom broker.core import gpus\n"
        "def test_x():\n    import hypothesis.strategies\n    pytest.importorskip('jsonschema')\n"
    )
    assert undeclared_imports([test_file], {"pyyaml"}) == [
        "test_sample.py: hypothesis (hypothesis)",
        "test_sample.py: jsonschema (jsonschema)",
    ]
    assert undeclared_imports([test_file], {"pyyaml", "hypothesis", "jsonschema"}) == []
