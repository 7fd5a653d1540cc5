"""The client SDK is the part users install on laptops and in jobs: it never imports the
broker's server side (the API, the scheduler, the embedded factory), and no module of
broker/ imports another in a cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SERVER_SIDE = ("broker.api", "broker.scheduling", "broker.client.embedded", "broker.simulation", "fastapi", "uvicorn")


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
