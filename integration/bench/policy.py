"""Validating large routing policies: ``broker.routing.validation.validate`` at 1k to 10k rules.

What it builds (not timed): a policy of N rules in YAML, as a site with many tenants
might write one (seeded, ``--seed``): matches that mix job kinds, isolations,
tenants (one to three of a pool of N/4), labels, GPU-count and GPU-memory ranges,
each routed to a mode of the shipped clusters (``slurm-a`` and ``k8s-a`` of
``examples/fleet.yaml``, as Slurm and Kubernetes clusters) that gives the isolation
its match admits; a catch-all ends it. Some rules are shadowed by earlier ones, as in
policies people write.

What it measures: the wall time of ``load_policy`` (YAML to the model; the rule cap,
``MAX_RULES``, is checked here), beside the same load through PyYAML's pure-Python
loader (the baseline: how gpush read YAML before libyaml's parser), and of ``validate``
(the checks against the clusters, the shadowed-rule check among them), the median of ``--rounds`` rounds, for each size
of ``--sizes`` and at the cap; a size above the cap is reported as refused. The
target (load and validate < 2 s at 10,000 rules, what ``POST /v1/policy:validate``
does) is printed beside the figures, never asserted. It exits 0 when it ran, 1 when something broke.

    .venv/bin/python integration/bench/policy.py --json policy-results.json
    .venv/bin/python integration/bench/policy.py --sizes 1000 2000 --rounds 1     # a quick look
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from broker.core import yamltext  # noqa: E402
from broker.core.clock import utcnow  # noqa: E402
from broker.core.errors import InvalidRequest  # noqa: E402
from broker.routing import rules as policy_rules  # noqa: E402
from broker.routing.policy import ClusterView, cluster_view, load_policy, validate  # noqa: E402
from broker.simulation.cluster import SimulatedCluster  # noqa: E402
from broker.simulation.fleet import load_fleet_file  # noqa: E402

FLEET = ROOT / "examples" / "fleet.yaml"
TARGET_SECONDS = 2.0  # validate, at 10,000 rules
TARGET_RULES = 10_000
KINDS = ["training", "inference", "batch"]
ISOLATIONS = ["exclusive", "hardware", "process", "none"]
LABELS = {"project": 40, "tier": 3, "queue": 6, "region": 4}  # label key -> how many values


def shipped_views() -> dict[str, ClusterView]:
    """The clusters of examples/fleet.yaml as a Slurm and a Kubernetes cluster (every
    mode of its flavor), with the fleet's inventory."""
    fleet = load_fleet_file(FLEET)
    views = {}
    for name, kind in (("slurm-a", "slurm"), ("k8s-a", "k8s")):
        cluster = SimulatedCluster.from_fleet(fleet, name, clock=utcnow)
        views[name] = cluster_view(name, kind, cluster.inventory())
    return views


def _route(strongest: str, rng: random.Random) -> str:
    # A mode that gives the strongest isolation the match admits, so most rules pass.
    if strongest == "exclusive":
        return rng.choice(["{cluster: slurm-a, sharing: slurm/exclusive}", "{cluster: k8s-a, sharing: k8s/exclusive}"])
    if strongest == "hardware":
        return rng.choice(["{cluster: slurm-a, sharing: slurm/mig}", "{cluster: k8s-a, sharing: k8s/mig}"])
    if strongest == "process":
        return "{cluster: slurm-a, sharing: slurm/mps}"
    return "{cluster: k8s-a, sharing: k8s/timeslice}"


def policy_text(rules: int, seed: int = 7) -> str:
    """A policy of ``rules`` rules in YAML, the same for one seed: tenants' own rules
    first (19 in 20), then rules for every tenant, then a catch-all."""
    rng = random.Random(seed)
    tenants = [f"team-{n}" for n in range(max(50, rules // 4))]
    lines = ["rules:"]
    for index in range(rules - 1):
        match: list[str] = []
        if index < rules * 0.95:
            match.append(f"tenant: [{', '.join(rng.sample(tenants, rng.randint(1, 3)))}]")
        if rng.random() < 0.6:
            match.append(f"kind: [{', '.join(rng.sample(KINDS, rng.randint(1, 2)))}]")
        admitted = ISOLATIONS
        if rng.random() < 0.5:
            admitted = rng.sample(ISOLATIONS, rng.randint(1, 3))
            match.append(f"isolation: [{', '.join(admitted)}]")
        if rng.random() < 0.4:
            keys = rng.sample(sorted(LABELS), rng.randint(1, 2))
            match.append("labels: {" + ", ".join(f"{k}: {k}-{rng.randrange(LABELS[k])}" for k in keys) + "}")
        if rng.random() < 0.4:
            low = rng.choice([1, 1, 2, 4])
            match.append(f"gpus: {{min: {low}, max: {low * rng.choice([1, 2, 4])}}}")
        if rng.random() < 0.4:
            low = rng.choice([0, 0, 2, 5])
            match.append(f"gpu_memory_gb: {{min: {low}, max: {low + rng.choice([4, 5, 10, 20, 40, 80])}}}")
        strongest = min(admitted, key=ISOLATIONS.index)
        lines += [
            f"  - name: rule-{index:05d}",
            f"    match: {{{', '.join(match)}}}",
            f"    route: {_route(strongest, rng)}",
        ]
    lines += ["  - name: everything-else", "    match: {}", "    route: {cluster: slurm-a, sharing: slurm/exclusive}"]
    return "\n".join(lines) + "\n"


def measure(rules: int, views: dict[str, ClusterView], rounds: int, seed: int) -> dict[str, Any]:
    text = policy_text(rules, seed)
    loads, checks, python_loads = [], [], []
    report = None
    for _ in range(rounds):
        t = time.perf_counter()
        try:
            policy = load_policy(text, f"{rules}-rule policy")
        except InvalidRequest as exc:
            return {"rules": rules, "refused": str(exc).splitlines()[0]}
        loads.append(time.perf_counter() - t)
        t = time.perf_counter()
        report = validate(policy, views)
        checks.append(time.perf_counter() - t)
        # The baseline beside it: the same load through PyYAML's pure-Python loader,
        # what gpush read every YAML with before libyaml's parser.
        saved, policy_rules.BoundedLoader = policy_rules.BoundedLoader, yamltext.PyBoundedLoader
        t = time.perf_counter()
        try:
            load_policy(text, f"{rules}-rule policy")
        finally:
            policy_rules.BoundedLoader = saved
        python_loads.append(time.perf_counter() - t)
    assert report is not None
    shadowed = sum(1 for f in report.errors if "never matches" in f.message)
    return {
        "rules": rules,
        "load_seconds": statistics.median(loads),
        "validate_seconds": statistics.median(checks),
        "total_seconds": statistics.median(a + b for a, b in zip(loads, checks, strict=True)),
        "python_loader_seconds": statistics.median(python_loads),
        "errors": len(report.errors),
        "shadowed": shadowed,
        "warnings": len(report.warnings),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000, 2_000, 5_000, 10_000], help="Rule counts.")
    parser.add_argument("--rounds", type=int, default=3, help="Timed rounds per size (the median is reported).")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", metavar="PATH", help="Also write the results as JSON to PATH.")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, a few seconds: that the bench runs (make test runs it); its figures mean nothing",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.rounds = [50], 1

    cap = getattr(policy_rules, "MAX_RULES", None)
    sizes = sorted(set(args.sizes) | ({cap} if cap and not args.smoke else set()))
    views = shipped_views()
    print(
        f"rule cap (MAX_RULES): {cap if cap else 'none'}; "
        f"target: load and validate < {TARGET_SECONDS:.0f}s at {TARGET_RULES}"
    )
    results = []
    for rules in sizes:
        result = measure(rules, views, args.rounds, args.seed)
        results.append(result)
        if "refused" in result:
            print(f"{rules:>6} rules: refused: {result['refused']}")
            continue
        print(
            f"{rules:>6} rules: load {result['load_seconds']:6.3f}s  validate {result['validate_seconds']:6.3f}s"
            f"  both {result['total_seconds']:6.3f}s  (pure-Python loader: load "
            f"{result['python_loader_seconds']:6.3f}s,"
            f" x{result['python_loader_seconds'] / result['load_seconds']:.1f});"
            f" {result['errors']} errors, {result['shadowed']} shadowed, {result['warnings']} warnings",
            flush=True,
        )

    if args.json:
        out = {
            "results": results,
            "max_rules": cap,
            "rounds": args.rounds,
            "seed": args.seed,
            "smoke": args.smoke,
            "targets": {"validate_seconds": TARGET_SECONDS, "at_rules": TARGET_RULES},
            "platform": platform.platform(),
            "python": platform.python_version(),
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
