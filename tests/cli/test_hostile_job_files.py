"""A hostile job file (issue 14) at `gpush submit -f`: an alias bomb or a file nested
thousands deep exits 2 with a short message naming the file, the line and the limit,
and queues nothing; never a traceback."""

from __future__ import annotations

import time

from broker.core.yamltext import MAX_ALIAS_NODES, MAX_DEPTH
from tests.core.test_yamltext import laughs, nested


def test_submit_refuses_the_billion_laughs_at_once(gpush, tmp_path):
    bomb = tmp_path / "job.yaml"
    bomb.write_text("kind: training\n" + laughs(key="command"))

    started = time.monotonic()
    result = gpush("submit", "-f", bomb)

    assert time.monotonic() - started < 5
    assert result.code == 2, result.err[-500:]
    assert f"{bomb}, line 7, column 10" in result.err and f"more than {MAX_ALIAS_NODES:,} nodes" in result.err
    assert len(result.err) < 1000
    assert gpush("list", "--json").json["jobs"] == []


def test_submit_refuses_a_job_file_nested_5000_deep_with_exit_2(gpush, tmp_path):
    deep = tmp_path / "job.yaml"
    deep.write_text("kind: training\n" + nested(5000, key="command"))

    result = gpush("submit", "-f", deep)

    assert result.code == 2, result.err[-500:]
    assert f"nested more than {MAX_DEPTH} levels deep" in result.err
    assert "Traceback" not in result.err and len(result.err.splitlines()) < 5
