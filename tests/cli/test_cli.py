"""The `gpush` command line, driven in-process as a user would type it.

No --url: every command runs the broker in this process on the embedded SQLite
database, which the autouse fixture of conftest.py puts in a fresh data directory
for each test.
"""

from __future__ import annotations

import io
import json
import stat
import sys
from typing import Any

import pytest

from broker.client.embedded import credentials_path

TRAINING = ("--kind", "training")


@pytest.fixture
def submit(gpush):
    """``gpush submit ARGS...`` that must succeed; returns the job id."""

    def run(*args: Any) -> int:
        result = gpush("submit", *args)
        assert result.code == 0, result.err
        return int(result.out)

    return run


def stored_spec(gpush, job_id: int, *global_args: Any) -> dict[str, Any]:
    result = gpush(*global_args, "status", job_id, "--json")
    assert result.code == 0, result.err
    return result.json["spec"]


def listed_ids(gpush, *filters: Any) -> list[int]:
    result = gpush("list", "--json", *filters)
    assert result.code == 0, result.err
    return [j["id"] for j in result.json["jobs"]]


# -- submit ---------------------------------------------------------------------------


def test_submit_prints_only_the_job_id(gpush):
    first = gpush("submit", *TRAINING, "--gpus", 2, "--", "python", "train.py")
    second = gpush("submit", *TRAINING, "--", "python", "train.py")

    assert (first.code, first.out) == (0, "1\n")
    assert (second.code, second.out) == (0, "2\n")
    spec = stored_spec(gpush, 1)
    assert (spec["kind"], spec["gpus"], spec["command"]) == ("training", 2, ["python", "train.py"])


def test_the_command_after_double_dash_reaches_the_stored_spec_unchanged(gpush, submit):
    argv = [
        "python",
        "-c",
        'import sys\nprint("it\'s", sys.argv)\n# done',
        "$(rm -rf /)",
        "`id`",
        "a; rm -rf ~",
        "x && y",
        "'single'",
        '"double"',
        "--gpus",
        "8",
        "*",
    ]

    job_id = submit(*TRAINING, "--", *argv)

    assert stored_spec(gpush, job_id)["command"] == argv


def test_whitespace_at_the_ends_of_an_argument_reaches_the_stored_spec(gpush, submit):
    argv = ["printf", "%s", "ends with newline\n", "  indented"]

    job_id = submit(*TRAINING, "--", *argv)

    assert stored_spec(gpush, job_id)["command"] == argv


def test_a_job_file_gives_the_fields_and_flags_override_them(gpush, submit, tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        "name: resnet\n"
        "kind: training\n"
        "gpus: 2\n"
        "priority: 1\n"
        "memory: 16GiB\n"
        "time_limit: 2h\n"
        "command: python train.py --epochs 90\n"
        "env: {DATA: /data, SEED: '1'}\n"
        "labels: {team: vision}\n"
    )

    job_id = submit(
        "-f", job_file, "--gpus", 4, "--env", "SEED=2", "--env", "WANDB_MODE=offline", "--label", "stage=dev"
    )

    spec = stored_spec(gpush, job_id)
    assert spec["name"] == "resnet"
    assert spec["gpus"] == 4
    assert spec["priority"] == 1
    assert (spec["memory"], spec["time_limit"]) == ("16G", "02:00:00")
    assert spec["command"] == ["/bin/sh", "-c", "python train.py --epochs 90"]
    assert spec["env"] == {"DATA": "/data", "SEED": "2", "WANDB_MODE": "offline"}
    assert spec["labels"] == {"team": "vision", "stage": "dev"}


def test_a_command_after_double_dash_overrides_the_files_command(gpush, submit, tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text("kind: training\ncommand: python train.py\n")

    job_id = submit("-f", job_file, "--", "python", "eval.py")

    assert stored_spec(gpush, job_id)["command"] == ["python", "eval.py"]


def test_elastic_flags_merge_with_the_files_replica_range(gpush, submit, tmp_path):
    job_file = tmp_path / "serve.yaml"
    job_file.write_text(
        "kind: inference\ngpu_memory_gb: 10\nimage: vllm/vllm-openai\nelastic: {min_replicas: 2, max_replicas: 4}\n"
    )

    job_id = submit("-f", job_file, "--max-replicas", 8)

    spec = stored_spec(gpush, job_id)
    assert spec["elastic"] == {"min_replicas": 2, "max_replicas": 8}
    assert spec["isolation"] == "none"


def test_a_file_of_several_documents_submits_them_all(gpush, tmp_path):
    job_file = tmp_path / "sweep.yaml"
    job_file.write_text(
        "".join(
            f"---\nname: lr-{lr}\nkind: training\ncommand: [python, train.py, --lr, '{lr}']\n"
            for lr in ("1e-3", "3e-4", "1e-4")
        )
    )

    result = gpush("submit", "-f", job_file, "--priority", 7)

    assert result.code == 0, result.err
    assert result.out.splitlines() == ["1", "2", "3"]
    jobs = gpush("list", "--json").json["jobs"]
    assert {j["name"]: j["spec"]["command"][-1] for j in jobs} == {
        "lr-1e-3": "1e-3",
        "lr-3e-4": "3e-4",
        "lr-1e-4": "1e-4",
    }
    assert {j["priority"] for j in jobs} == {7}


def test_a_job_file_can_come_from_stdin(gpush, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("name: from-stdin\nkind: batch\ncommand: date\n"))

    result = gpush("submit", "-f", "-")

    assert (result.code, result.out) == (0, "1\n")
    assert stored_spec(gpush, 1)["name"] == "from-stdin"


def test_a_yaml_syntax_error_names_line_and_column_and_writes_nothing(gpush, tmp_path):
    job_file = tmp_path / "broken.yaml"
    job_file.write_text("kind: training\ncommand: [python, train.py\ngpus: 2\n")

    result = gpush("submit", "-f", job_file)

    assert result.code == 2
    assert result.out == ""
    assert str(job_file) in result.err
    assert "line 3, column" in result.err
    assert gpush("list", "--json").json["jobs"] == []


def test_an_invalid_job_exits_2_names_field_and_value_and_writes_nothing(gpush):
    result = gpush("submit", *TRAINING, "--gpus", 0, "--priority", 5000, "--", "python", "train.py")

    assert result.code == 2
    assert result.out == ""
    assert "gpus = 0" in result.err and "greater than or equal to 1" in result.err
    assert "priority = 5000" in result.err
    assert gpush("list", "--json").json["jobs"] == []


def test_a_job_without_a_command_is_refused_naming_the_command(gpush):
    result = gpush("submit", *TRAINING, "-G", 1)

    assert result.code == 2 and result.out == ""
    assert "command: missing: give the job a command (after --), an image, or both" in result.err
    assert "image:" not in result.err
    assert gpush("list", "--json").json["jobs"] == []


@pytest.mark.parametrize(("memory", "note"), [("16", True), (" 512 ", True), ("16G", False), ("512M", False)])
def test_a_bare_memory_number_is_said_to_be_megabytes(gpush, memory, note):
    result = gpush("submit", *TRAINING, "--memory", memory, "--", "true")

    assert result.code == 0 and result.out.strip().isdigit()
    said = f"--memory {memory.strip()} is {memory.strip()} MB (a bare number is megabytes, as in sbatch)"
    assert (said in result.err) is note
    if note:
        assert stored_spec(gpush, int(result.out))["memory"] == f"{memory.strip()}M"


def test_one_invalid_job_in_a_file_refuses_the_whole_file(gpush, tmp_path):
    job_file = tmp_path / "jobs.yaml"
    job_file.write_text("kind: training\ncommand: a\n---\nkind: training\ncommand: b\ngpus: 0\n")

    result = gpush("submit", "-f", job_file)

    assert result.code == 2
    assert "job 2" in result.err and "gpus = 0" in result.err
    assert gpush("list", "--json").json["jobs"] == []


def test_an_unknown_field_in_a_file_is_refused(gpush, tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text("kind: training\ncommand: a\ngpu: 4\n")

    result = gpush("submit", "-f", job_file)

    assert result.code == 2
    assert "gpu = 4" in result.err


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--kind", "gpu", "--", "a"), "'gpu' is not one of"),
        ((*TRAINING, "--env", "NOVALUE", "--", "a"), "--env 'NOVALUE': write KEY=VALUE"),
        ((*TRAINING, "-f", "/nonexistent/job.yaml"), "/nonexistent/job.yaml does not exist"),
    ],
)
def test_usage_errors_exit_2(gpush, args, said):
    result = gpush("submit", *args)

    assert result.code == 2
    assert said in result.err


# -- reading jobs ---------------------------------------------------------------------


def test_read_commands_print_only_json_with_json(gpush, submit):
    job_id = submit(*TRAINING, "--", "python", "train.py")

    status = gpush("status", job_id, "--json").json
    events = gpush("events", job_id, "--json").json
    page = gpush("list", "--json").json
    me = gpush("whoami", "--json").json
    tokens = gpush("admin", "token", "list", "--json").json

    assert (status["id"], status["state"]) == (job_id, "queued")
    assert [(e["from_state"], e["to_state"], e["reason"]) for e in events] == [(None, "queued", "submitted")]
    assert [j["id"] for j in page["jobs"]] == [job_id] and page["next_cursor"] is None
    assert (me["tenant"], me["role"]) == ("default", "admin")
    assert [(t["user"], t["role"]) for t in tokens] == [(me["user"], "admin")]


def test_token_list_never_shows_a_secret(gpush):
    gpush("whoami")
    secret = next(iter(json.loads(credentials_path().read_text()).values()))["token"]

    result = gpush("admin", "token", "list", "--json")

    assert result.code == 0
    assert secret not in result.out
    assert "token" not in result.json[0]


def test_status_and_events_read_like_a_person_would(gpush, submit):
    job_id = submit(*TRAINING, "--name", "resnet", "--", "python", "train.py", "it's")

    status = gpush("status", job_id)
    events = gpush("events", job_id)

    assert status.code == events.code == 0
    assert "resnet" in status.out and "queued" in status.out
    assert "python train.py 'it'\"'\"'s'" in status.out  # shell-quoted, copy-pasteable
    assert "submitted" in events.out


def test_list_filters_by_state_kind_user_and_tenant(gpush, submit):
    cancelled = submit(*TRAINING, "--", "a")
    inference = submit("--kind", "inference", "--gpu-memory-gb", 10, "--image", "vllm")
    bobs = submit(*TRAINING, "--tenant", "vision", "--user", "bob", "--", "b")
    assert gpush("cancel", cancelled).code == 0

    assert listed_ids(gpush) == [bobs, inference]  # the active ones, as squeue shows
    assert listed_ids(gpush, "--all") == [bobs, inference, cancelled]
    assert listed_ids(gpush, "--state", "queued") == [bobs, inference]
    assert listed_ids(gpush, "--state", "cancelled") == [cancelled]
    assert listed_ids(gpush, "--state", "cancelled", "--state", "queued") == [bobs, inference, cancelled]
    assert listed_ids(gpush, "--kind", "inference") == [inference]
    assert listed_ids(gpush, "--user", "bob") == [bobs]
    assert listed_ids(gpush, "--tenant", "vision") == [bobs]
    assert listed_ids(gpush, "--tenant", "default", "--kind", "training") == []
    assert listed_ids(gpush, "-A", "--tenant", "default", "--kind", "training") == [cancelled]
    assert listed_ids(gpush, "--tenant", "nobody") == []


def test_list_pages_walk_every_job_newest_first_without_duplicates(gpush, tmp_path):
    job_file = tmp_path / "jobs.yaml"
    job_file.write_text("".join(f"---\nname: j{i}\nkind: batch\ncommand: 'true'\n" for i in range(5)))
    assert gpush("submit", "-f", job_file).code == 0

    seen, cursor, pages = [], None, 0
    while True:
        page = gpush("list", "--json", "--limit", 2, *(("--cursor", cursor) if cursor else ())).json
        pages += 1
        assert len(page["jobs"]) <= 2
        seen += [j["id"] for j in page["jobs"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break

    assert seen == [5, 4, 3, 2, 1]
    assert pages == 3
    everything = gpush("list", "--json", "--all-pages", "--limit", 2).json
    assert [j["id"] for j in everything["jobs"]] == [5, 4, 3, 2, 1]
    assert everything["next_cursor"] is None


def test_a_person_is_told_how_to_get_the_next_page(gpush, submit):
    for _ in range(3):
        submit(*TRAINING, "--", "a")

    result = gpush("list", "--limit", 2)

    assert result.code == 0
    assert "gpush list --cursor" in result.err


def test_a_cursor_gpush_did_not_give_is_a_usage_error(gpush):
    result = gpush("list", "--cursor", "not-a-cursor")

    assert result.code == 2
    assert "not-a-cursor" in result.err


def test_an_unknown_job_exits_3(gpush, submit):
    submit(*TRAINING, "--", "a")

    for command in ("status", "events"):
        result = gpush(command, 999, "--json")
        assert result.code == 3, command
        assert result.out == ""
        assert "999" in result.err


# -- cancel ---------------------------------------------------------------------------


def test_cancelling_a_queued_job_ends_it_at_once(gpush, submit):
    job_id = submit(*TRAINING, "--", "a")

    result = gpush("cancel", job_id)

    assert (result.code, result.out) == (0, f"job {job_id} cancelled\n")
    assert gpush("status", job_id, "--json").json["state"] == "cancelled"
    assert [e["to_state"] for e in gpush("events", job_id, "--json").json] == ["queued", "cancelled"]
    again = gpush("cancel", job_id)
    assert again.code == 0 and "already ended" in again.out


def test_cancel_goes_on_past_a_missing_job_and_exits_3(gpush, submit):
    job_id = submit(*TRAINING, "--", "a")

    result = gpush("cancel", job_id, 999)

    assert result.code == 3
    assert f"job {job_id} cancelled" in result.out
    assert "999" in result.err
    assert gpush("status", job_id, "--json").json["state"] == "cancelled"


def test_cancel_json_reports_each_outcome(gpush, submit):
    job_id = submit(*TRAINING, "--", "a")

    result = gpush("cancel", job_id, 999, "--json")

    assert result.code == 3
    assert [(r["id"], r["outcome"]) for r in result.json] == [(job_id, "cancelled"), (999, "not_found")]


# -- idempotency ----------------------------------------------------------------------


def test_the_same_idempotency_key_and_spec_give_the_same_job(gpush, submit):
    first = submit(*TRAINING, "--idempotency-key", "run-7", "--time-limit", "2h", "--", "a")
    replay = submit(*TRAINING, "--idempotency-key", "run-7", "--time-limit", "120", "--", "a")

    assert replay == first
    assert listed_ids(gpush) == [first]


def test_the_same_idempotency_key_with_another_spec_is_a_conflict(gpush, submit):
    first = submit(*TRAINING, "--idempotency-key", "run-7", "--", "a")

    result = gpush("submit", *TRAINING, "--gpus", 2, "--idempotency-key", "run-7", "--", "a")

    assert result.code == 1
    assert result.out == ""
    assert "run-7" in result.err and "different spec" in result.err
    assert listed_ids(gpush) == [first]


# -- global options, credentials, database ---------------------------------------------


def test_top_level_help_names_the_environment_variables(gpush):
    result = gpush("--help")

    assert result.code == 0
    for name in ("GPUSH_URL", "GPUSH_TOKEN", "GPUSH_DATABASE_URL"):
        assert name in result.out


def test_the_local_admin_credentials_are_readable_by_the_user_alone(gpush):
    assert not credentials_path().exists()

    first = gpush("whoami", "--json")

    assert first.code == 0
    assert stat.S_IMODE(credentials_path().stat().st_mode) == 0o600
    saved = credentials_path().read_text()
    assert gpush("whoami", "--json").json == first.json
    assert credentials_path().read_text() == saved  # the same token is reused, not a new one each time


def test_db_current_reports_up_to_date_after_first_use(gpush):
    gpush("whoami")

    result = gpush("db", "current", "--json")

    assert result.code == 0
    assert result.json["up_to_date"] is True
    assert result.json["current"] == result.json["head"]


def test_an_unreachable_broker_exits_1_and_says_so(gpush):
    # The client retries with backoff (about 1.5 s here) before it gives up.
    result = gpush("--url", "http://127.0.0.1:9", "list", "--json")

    assert result.code == 1
    assert result.out == ""
    assert "cannot reach the gpush broker at http://127.0.0.1:9" in result.err


# -- tokens and tenants ---------------------------------------------------------------


@pytest.fixture
def bob_token(gpush) -> str:
    result = gpush("admin", "token", "create", "--user", "bob", "--tenant", "vision")
    assert result.code == 0, result.err
    (token,) = result.out.split()
    return token


def test_admin_token_create_prints_the_token_alone(gpush):
    result = gpush("admin", "token", "create", "--user", "bob", "--tenant", "vision")

    assert result.code == 0
    assert result.out.startswith("gpush_") and len(result.out.splitlines()) == 1
    assert "GPUSH_TOKEN" in result.err


def test_a_user_token_sees_only_its_tenant(gpush, submit, bob_token):
    admins = submit(*TRAINING, "--", "a")
    bob = ("--token", bob_token)

    result = gpush(*bob, "submit", *TRAINING, "--", "python", "bob.py")
    assert result.code == 0, result.err
    bobs = int(result.out)

    assert gpush(*bob, "whoami", "--json").json == {"user": "bob", "tenant": "vision", "role": "user"}
    page = gpush(*bob, "list", "--json").json
    assert [(j["id"], j["tenant"], j["user"]) for j in page["jobs"]] == [(bobs, "vision", "bob")]
    assert gpush(*bob, "list", "--json", "--tenant", "default").json["jobs"] == []
    assert gpush(*bob, "status", admins).code == 3
    assert gpush(*bob, "cancel", admins).code == 3
    assert gpush("status", admins, "--json").json["state"] == "queued"
    assert listed_ids(gpush) == [bobs, admins]  # the admin sees every tenant


def test_a_user_token_may_not_administer_or_submit_for_others(gpush, bob_token):
    bob = ("--token", bob_token)

    assert gpush(*bob, "admin", "token", "list").code == 4
    assert gpush(*bob, "admin", "token", "create", "--user", "eve", "--tenant", "vision").code == 4
    refused = gpush(*bob, "submit", *TRAINING, "--tenant", "default", "--", "a")
    assert refused.code == 4
    assert "tenant 'default'" in refused.err
    assert gpush("list", "--json").json["jobs"] == []


def test_gpush_token_in_the_environment_works_like_the_option(gpush, bob_token, monkeypatch):
    monkeypatch.setenv("GPUSH_TOKEN", bob_token)

    assert gpush("whoami", "--json").json["user"] == "bob"
    assert gpush("admin", "token", "list").code == 4


@pytest.mark.parametrize("how", ["option", "environment"])
def test_a_garbage_token_exits_4(gpush, monkeypatch, how):
    if how == "environment":
        monkeypatch.setenv("GPUSH_TOKEN", "gpush_not-a-real-token")
        result = gpush("list", "--json")
    else:
        result = gpush("--token", "gpush_not-a-real-token", "list", "--json")

    assert result.code == 4
    assert result.out == ""
