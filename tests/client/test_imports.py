"""The package arrows of docs/architecture.md, held: the client SDK (laptops, jobs), the node
agent and the budget helper never import the broker's server side; no module of broker/ or
adapters/ imports another in a cycle; every import, at module level or inside a function,
points down the map of floors (MAY_IMPORT), which has no circle itself; and no product
module imports the test doubles."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVER_SIDE = (
    "broker.api",
    "broker.scheduling",
    "broker.fleet",
    "broker.client.embedded",
    "broker.simulation",
    "fastapi",
    "uvicorn",
)


@pytest.mark.parametrize(
    "module", ["broker.client.sdk", "broker.nodeagent.agent", "broker.nodeagent.mig_apply", "broker.jobenv.budget"]
)
def test_what_runs_outside_the_broker_imports_nothing_of_the_server(module: str) -> None:
    """The SDK (laptops, jobs), the node agent (GPU nodes) and the budget helper (inside
    jobs) run where the broker does not."""
    probe = (
        f"import sys, {module}\n"
        f"bad = sorted(m for m in sys.modules if m.startswith({SERVER_SIDE!r}))\n"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, f"{module} pulls in {result.stdout.strip()} {result.stderr[-500:]}"


def _module_imports() -> dict[str, set[str]]:
    """Module-level imports between gpush's own modules (those inside functions and under
    TYPE_CHECKING are deliberate late bindings and not counted)."""
    modules = {}
    for path in [*(ROOT / "broker").rglob("*.py"), *(ROOT / "adapters").rglob("*.py")]:
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[name] = path
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for alias in node.names:
                    target = f"{node.module}.{alias.name}"
                    target = target if target in modules else node.module
                    if target in modules and target != name:
                        edges[name].add(target)
    return edges


def test_no_import_cycles() -> None:
    edges = _module_imports()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(edges.get(module, ())):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(edges):
        if module not in state and (cycle := visit(module)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


# The floors of docs/architecture.md: each unit (a package, or the one module named) and the
# units it may import. Nothing else: an import of any other unit of gpush, at module level or
# inside a function, is an arrow running up or sideways. The map itself has no circle (below).
MAY_IMPORT: dict[str, set[str]] = {
    "broker": set(),  # the package itself: __version__
    "broker.core": {"broker"},
    "broker.jobenv": {"broker.core"},
    "broker.budget": {"broker.jobenv"},
    "broker.intake": {"broker.core"},
    "broker.inventory": {"broker.core"},
    "broker.routing": {"broker.core", "broker.intake"},
    "broker.accounting": {"broker.core", "broker.intake"},
    "broker.mig": {"broker.core", "broker.inventory", "broker.routing"},
    "broker.placement": {"broker.accounting", "broker.core", "broker.routing"},
    "broker.client.sdk": {"broker.core"},
    "broker.nodeagent": {"broker", "broker.core", "broker.inventory", "broker.mig"},
    "adapters.settings": {"broker.core"},
    "adapters.slurm": {"adapters.settings", "broker.core", "broker.jobenv", "broker.mig"},
    "adapters.k8s": {"adapters.settings", "broker.core", "broker.jobenv", "broker.mig"},
    "broker.fleet": {
        "broker.core",
        "broker.intake",
        "broker.inventory",
        "broker.mig",
        "broker.placement",
        "broker.routing",
    },
    "broker.scheduling": {
        "broker.accounting",
        "broker.core",
        "broker.fleet",
        "broker.intake",
        "broker.inventory",
        "broker.placement",
        "broker.routing",
    },
    "broker.simulation": {"broker.core", "broker.intake", "broker.mig", "broker.placement", "broker.routing"},
    "broker.api": {
        "broker",
        "broker.accounting",
        "broker.core",
        "broker.fleet",
        "broker.intake",
        "broker.inventory",
        "broker.mig",
        "broker.placement",
        "broker.routing",
        "broker.scheduling",
    },
    "broker.client": {"broker.api", "broker.client.sdk", "broker.core"},  # embedded, local
    "broker.ray": {"broker.client.sdk", "broker.core"},
    "broker.ray_provider": {"broker.ray"},
    # The CLI is the top floor: it may import any unit of the broker, and the Kubernetes
    # adapter's time-slicing renderer, which `gpush cluster timeslice render` runs offline.
    "broker.cli": {
        "adapters.k8s",
        "broker",
        "broker.accounting",
        "broker.api",
        "broker.client",
        "broker.client.sdk",
        "broker.core",
        "broker.intake",
        "broker.mig",
        "broker.nodeagent",
        "broker.placement",
        "broker.ray",
        "broker.routing",
        "broker.scheduling",
        "broker.simulation",
    },
}


def _unit(module: str) -> str | None:
    """The unit of the map a module belongs to (the longest name that prefixes it)."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in MAY_IMPORT:
            return ".".join(parts[:end])
    return None


def _all_imports() -> list[tuple[str, int, str]]:
    """(module, line, imported module) for every import of gpush's own code, at module level,
    inside functions and under TYPE_CHECKING alike."""
    out = []
    for path in [*(ROOT / "broker").rglob("*.py"), *(ROOT / "adapters").rglob("*.py")]:
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                if target.split(".")[0] in ("broker", "adapters"):
                    out.append((name, node.lineno, target))
    return out


def test_every_arrow_points_down_the_map() -> None:
    wrong = []
    for module, line, target in _all_imports():
        source, imported = _unit(module), _unit(target)
        if source is None:
            wrong.append(f"{module} is on no floor of MAY_IMPORT: add its package")
        elif imported is not None and imported != source and imported not in MAY_IMPORT[source]:
            # `from broker.cli import x` names a module; `from broker.client.sdk import X` a name
            # in one: only the longest unit counts, so a name never widens what is imported.
            wrong.append(f"{module}:{line} imports {target} ({source} may not import {imported})")
    assert not sorted(set(wrong)), "\n".join(sorted(set(wrong)))


def test_the_map_has_no_circle() -> None:
    state: dict[str, int] = {}

    def visit(unit: str, path: list[str]) -> None:
        state[unit] = 1
        for below in sorted(MAY_IMPORT[unit]):
            assert state.get(below) != 1, "circle in MAY_IMPORT: " + " -> ".join([*path, unit, below])
            if below not in state:
                visit(below, [*path, unit])
        state[unit] = 2

    for unit in sorted(MAY_IMPORT):
        if unit not in state:
            visit(unit, [])


def test_no_product_module_imports_the_test_doubles() -> None:
    doubles = [(m, line, t) for m, line, t in _all_imports() if t.startswith("tests")]
    assert doubles == []


# A room that fits: a module of broker/ or adapters/ over this many lines says in its
# docstring why it is one piece ("... on purpose: ..."), or it is split by concern.
MODULE_LINES = 600


def test_every_module_fits_its_room_or_says_why_it_is_one_piece() -> None:
    over = []
    for path in [*(ROOT / "broker").rglob("*.py"), *(ROOT / "adapters").rglob("*.py")]:
        text = path.read_text()
        lines = text.count("\n")
        if lines > MODULE_LINES and "on purpose" not in (ast.get_docstring(ast.parse(text)) or ""):
            over.append(f"{path.relative_to(ROOT)}: {lines} lines")
    assert over == [], "split by concern, or say in the docstring why it is one piece:\n" + "\n".join(over)
