"""Each benchmark of integration/bench/ runs: its ``--smoke`` mode (tiny sizes, seconds) as a
subprocess, as ``make bench`` runs it, exits 0 and writes JSON with the figures it reports.

Here the benches that need no service (placement, policies, inventory); those that need
PostgreSQL, Slurm, the Kubernetes test server, Ray or chromium are in
integration/test_bench_smoke.py. A bench that breaks (a renamed interface, a changed
signature) then fails ``make test`` rather than the next ``make bench``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "integration" / "bench"


def run_bench(name: str, out: Path, *args: str, timeout: float = 300, env: dict[str, str] | None = None) -> Any:
    """``integration/bench/NAME.py --smoke --json OUT ARGS`` in its own process, from the
    repository root with this tree first on the path; the JSON it wrote."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GPUSH_")} | (env or {})
    environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    command = [sys.executable, str(BENCH / f"{name}.py"), "--smoke", "--json", str(out), *args]
    done = subprocess.run(command, cwd=ROOT, env=environ, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (
        f"{name} bench exited {done.returncode}\nstdout:\n{done.stdout[-4000:]}\nstderr:\n{done.stderr[-4000:]}"
    )
    return json.loads(out.read_text())


def test_the_placement_bench_runs(tmp_path):
    result = run_bench("placement", tmp_path / "placement.json")
    assert result["smoke"] is True and result["seeds"] == 1
    (default,) = result["lists"]
    medians = default["medians"]
    assert default["list"] == "default"
    assert set(medians) == {"gpush", "joint", "best", "first", "whole", "bound", "offline"}
    assert all(0.5 < value <= 1.0 for value in medians.values()), medians
    # The bound is one: nothing placed more than it.
    assert max(medians[name] for name in ("gpush", "joint", "best", "first", "whole")) <= medians["bound"] + 1e-9
    assert default["room"] >= 0
    for name in ("gpush (fgd)", "whole GPUs (best-fit)"):
        assert result["replay"][name]["placed"] > 0


def test_the_topology_bench_runs(tmp_path):
    result = run_bench("topology", tmp_path / "topology.json")
    assert result["smoke"] is True and result["jobs"] > 0
    aware, blind = result["runs"]["topology-aware"], result["runs"]["blind"]
    for row in (aware, blind):
        assert row["multi_gpu_jobs"] > 0 and row["gangs_started"] > 0
        assert 0 < row["allocation"] <= 1 and row["wait"]["all"]["p95"] is not None
    # Topology-aware placement puts every gang of the smoke run on the fewest blocks; blind does not.
    assert aware["gang_share"] == 1.0 and blind["gang_share"] < 1.0


def test_the_policy_bench_runs(tmp_path):
    result = run_bench("policy", tmp_path / "policy.json")
    (size,) = result["results"]
    assert size["rules"] == 50
    assert size["load_seconds"] > 0 and size["validate_seconds"] > 0 and size["python_loader_seconds"] > 0
    assert size["shadowed"] >= 0 and result["max_rules"] >= 1000


def test_the_inventory_bench_runs(tmp_path):
    result = run_bench("inventory", tmp_path / "inventory.json")
    assert result["nodes"] == 200 and result["units"] > 0 and result["agent_reports"] >= 200
    assert result["reconcile_seconds"]["median"] > 0
    # Drift was injected, so reconcile found some.
    assert sum(result["findings"].values()) > 0
