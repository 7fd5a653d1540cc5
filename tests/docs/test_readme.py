"""The README says what the code does: its limits table, the batch size it names, the
files and paths it points a reader at, and the words it uses for what was tested."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from broker.api.limits import HttpLimits
from broker.core.spec_values import SpecLimits

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def table_rows(heading: str) -> dict[str, str]:
    """The first markdown table after ``heading``: first cell -> second cell, unquoted."""
    section = README[README.index(heading) :]
    rows: dict[str, str] = {}
    for line in section.splitlines()[1:]:
        if line.startswith("#"):
            break
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and not set(cells[0]) <= set("- "):
            rows[cells[0]] = cells[1]
        elif rows and not line.strip():
            break
    return rows


def test_the_limits_table_lists_every_spec_limit_with_its_default():
    rows = table_rows("### Limits on a job spec")
    limits = {SpecLimits.setting(f.name): f.default for f in dataclasses.fields(SpecLimits)}
    assert {k: int(v) for k, v in rows.items() if k.startswith("GPUSH_MAX_")} == limits


def test_the_http_limits_the_readme_names_have_their_defaults():
    named = {
        f"GPUSH_{f.name.upper()}": f.default
        for f in dataclasses.fields(HttpLimits)
        if f"GPUSH_{f.name.upper()}" in README
    }
    assert named, "the README names no HTTP limit"
    for setting, default in named.items():
        row = re.search(rf"\| `{setting}` \| (\d+)", README)
        assert row, f"{setting} is named but not in a table with its default"
        assert int(row.group(1)) == default, setting


def test_every_batch_size_the_readme_states_is_the_limit():
    default = SpecLimits().batch_jobs
    found = re.findall(r"(\d[\d,]*)-job batch|up to `GPUSH_MAX_BATCH_JOBS` \(([\d,]+)\)", README)
    said = {int((a or b).replace(",", "")) for a, b in found}
    assert said == {default}
    assert "50,000" not in README


PATH = re.compile(r"`((?:broker|adapters|integration|tests|deploy|docs|examples|policies|migrations|data)/[\w./-]+)`")


@pytest.mark.parametrize("path", sorted(set(PATH.findall(README))))
def test_every_path_the_readme_names_exists(path):
    assert (ROOT / path.rstrip("/")).exists(), f"README names {path}, which is not in the repository"


def test_the_readme_calls_the_nvml_files_synthetic_not_recorded():
    assert "recorded NVML" not in README
    assert "synthetic NVML answers" in README


def test_the_readme_says_kubernetes_was_tested_on_the_test_server_only():
    section = README[README.index("### A real Kubernetes cluster") :][:1500]
    assert "test API server" in section and "no test has run on a real cluster yet" in section
    assert "make k8s-contract" in section
    assert "### What is tested against what" in README
