"""The web dashboard in a real browser: Debian's chromium driven by Playwright, against a
real `gpush server` (PostgreSQL, the simulated clusters of examples/fleet.yaml, the
scheduler on), as a user of tenant vision, a user of tenant nlp and an admin.

Screenshots go to $GPUSH_WEB_SHOTS (default: the test's temporary directory); the
README's come from the demo fleet the same way (integration/bench/dashboard.py --shots).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from integration.conftest import ADMIN_DSN, _sqlalchemy_url, create_database, drop_database
from integration.test_servers import gpush, start_server

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


class Site:
    """A running broker with jobs of two tenants on the simulated fleet."""

    def __init__(self, url: str, database_url: str) -> None:
        self.url = url
        self.database_url = database_url
        self.tokens: dict[str, str] = {}
        self.jobs: dict[str, int] = {}

    def token(self, user: str, tenant: str, role: str = "user") -> str:
        args = ["--database-url", self.database_url, "admin", "token", "create", "--user", user, "--tenant", tenant]
        self.tokens[user] = gpush(*args, "--role", role).stdout.strip()
        return self.tokens[user]

    def submit(self, user: str, *args: str) -> int:
        out = gpush("--url", self.url, "--token", self.tokens[user], "submit", *args).stdout.strip()
        return int(out.split()[-1])

    def job(self, job_id: int) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {self.tokens['root']}"}
        return httpx.get(f"{self.url}/v1/jobs/{job_id}", headers=headers).json()

    def wait_for(self, job_id: int, *states: str, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job["state"] in states:
                return job
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id} is {job['state']}, not {states}: {job['state_reason']}")
            time.sleep(0.3)


@pytest.fixture(scope="module")
def site(pg_template) -> Iterator[Site]:
    name = create_database(pg_template)
    database_url = _sqlalchemy_url(ADMIN_DSN, name)
    admin = ["--database-url", database_url]
    fleet = str(ROOT / "examples" / "fleet.yaml")
    for cluster in ("slurm-a", "k8s-a"):
        gpush(*admin, "cluster", "add", cluster, "--kind", "sim", "--fleet", fleet, "--speed", "60")
    gpush(*admin, "policy", "apply", str(ROOT / "policies" / "default.yaml"), "-m", "the policy gpush ships")
    proc, url = start_server(database_url, "--workers", "1")
    site = Site(url, database_url)
    try:
        site.token("root", "ops", "admin")
        site.token("alice", "vision")
        site.token("bob", "nlp")
        gpush(
            "--url",
            url,
            "--token",
            site.tokens["root"],
            "agent",
            "--once",
            "--node",
            "mig-01",
            "--recording",
            str(ROOT / "tests" / "data" / "nvml" / "mig01.json"),
        )
        site.jobs["train"] = site.submit(
            "alice",
            "--name",
            "vit-finetune",
            "--kind",
            "training",
            "--isolation",
            "hardware",
            "--gpu-memory-gb",
            "10",
            "--time-limit",
            "8h",
            "--",
            "python",
            "train.py",
        )
        site.jobs["held"] = site.submit(
            "alice", "--name", "too-big", "--kind", "training", "--gpus", "16", "--", "python", "huge.py"
        )
        site.jobs["spare"] = site.submit(
            "alice", "--name", "markup", "--kind", "training", "--gpus", "16", "--", "<img src=x onerror=alert(1)>"
        )
        site.jobs["bob"] = site.submit(
            "bob",
            "--name",
            "bob-secret-model",
            "--kind",
            "training",
            "--isolation",
            "hardware",
            "--gpu-memory-gb",
            "4",
            "--time-limit",
            "8h",
            "--",
            "python",
            "b.py",
        )
        # Placed: the cluster has them (the simulated cluster starts them in its own time).
        site.wait_for(site.jobs["train"], "submitted", "running")
        site.wait_for(site.jobs["bob"], "submitted", "running")
        site.wait_for(site.jobs["held"], "held")
        yield site
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        drop_database(name)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert os.path.exists(CHROMIUM), (
        "Debian's chromium is missing: make browser (integration/scripts/ensure-chromium.sh)"
    )
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda e: problems.append(f"uncaught: {e}"))
    yield page
    context.close()
    assert not problems, problems


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    path = Path(os.environ.get("GPUSH_WEB_SHOTS") or tmp_path_factory.mktemp("shots"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def sign_in(page: Page, site: Site, user: str) -> None:
    page.goto(site.url + "/")
    # The page draws the sign-in form or who is signed in once its script has run: wait for
    # one of them before deciding (a check right after goto can run before either is drawn).
    whoami, form = page.get_by_test_id("whoami"), page.get_by_label("API token")
    expect(whoami.or_(form)).to_be_visible()
    if whoami.is_visible():
        page.get_by_role("button", name="Sign out").click()
    form.fill(site.tokens[user])
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_test_id("whoami")).to_contain_text(user)


def test_sign_in_and_see_why_a_held_job_waits(page, site, shots):
    sign_in(page, site, "alice")
    row = page.locator(f"tr[data-job='{site.jobs['held']}']")
    expect(row).to_contain_text("held")
    expect(row).to_contain_text("can never fit")
    expect(page.get_by_test_id("state-tabs")).to_contain_text("held")
    page.screenshot(path=shots / "queue.png", full_page=True)


def test_a_wrong_token_is_refused_with_what_to_do(page, site):
    page.goto(site.url + "/")
    page.get_by_label("API token").fill("gpush_not-a-token")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_be_visible()
    expect(page.get_by_test_id("whoami")).to_have_count(0)


def test_a_sign_in_link_signs_in_and_leaves_no_token_in_the_address_bar(page, site):
    page.goto(f"{site.url}/#token={site.tokens['alice']}")
    expect(page.get_by_test_id("whoami")).to_contain_text("alice")
    assert "token" not in page.url
    # The token lives in this tab only: a new tab (another context) must sign in again.
    assert page.evaluate("sessionStorage.getItem('gpush.token')") == site.tokens["alice"]
    assert page.context.cookies() == []


def test_a_sign_in_link_works_in_a_tab_already_open(page, site):
    sign_in(page, site, "bob")
    page.goto(f"{site.url}/#token={site.tokens['alice']}")
    expect(page.get_by_test_id("whoami")).to_contain_text("alice")
    assert "token" not in page.url


def test_a_filter_the_api_refuses_says_why_and_keeps_the_form(page, site):
    sign_in(page, site, "alice")
    page.get_by_label("label").fill("no-equals-sign")
    page.get_by_role("button", name="Filter").click()
    expect(page.get_by_role("alert")).to_contain_text("KEY=VALUE")
    expect(page.get_by_role("button", name="Filter")).to_be_visible()  # the form stays, to correct it


def test_open_a_job_and_see_its_events_and_where_it_runs(page, site, shots):
    sign_in(page, site, "alice")
    page.get_by_role("link", name=f"#{site.jobs['train']}", exact=True).click()
    expect(page.get_by_test_id("events")).to_contain_text("submitted")
    expect(page.get_by_test_id("events")).to_contain_text("routed")
    placement = page.get_by_test_id("placement")
    expect(placement).to_contain_text("slurm-a")
    expect(placement).to_contain_text("mig-01")
    expect(placement).to_contain_text("3g.20gb")
    page.screenshot(path=shots / "job.png", full_page=True)


def test_a_gang_shows_its_shape_in_the_queue_and_every_node_and_rank_on_its_page(page, site, shots):
    gang = site.submit("alice", "--name", "gang-pretrain", "-k", "training", "-N", "2", "-G", "4", "--", "torchrun")
    # Placed and handed to the simulated cluster, which starts it at once (its nodes are free).
    job = site.wait_for(gang, "submitted", "running", "succeeded")
    first, second = job["placement"]["nodes"]
    try:
        sign_in(page, site, "alice")
        row = page.locator(f"tr[data-job='{gang}']")
        expect(row.get_by_test_id("asked")).to_have_text("2x4 A100")  # as `gpush list` shows it
        page.set_viewport_size({"width": 1280, "height": 760})
        page.screenshot(path=shots / "queue-gang.png")
        row.get_by_role("link", name=f"#{gang}", exact=True).click()
        nodes = page.get_by_test_id("gang").locator("tbody tr")
        expect(nodes).to_have_count(2)
        expect(nodes.nth(0)).to_contain_text(f"{first} (rendezvous)")
        expect(nodes.nth(0).locator("td").nth(2)).to_have_text("0")
        expect(nodes.nth(1)).to_contain_text(second)
        expect(nodes.nth(1).locator("td").nth(2)).to_have_text("1")
        expect(page.locator("main")).to_contain_text("2 nodes, 1 task (rank) per node, 2 ranks in all")
        # Each rank's output, chosen by rank: the simulated cluster's says which rank and node.
        expect(page.get_by_test_id("logs")).to_contain_text(f"rank 0 of 2 (node rank 0 of 2) started on {first}")
        page.get_by_label("rank").select_option(label=f"rank 1 on {second}")
        expect(page.get_by_test_id("logs")).to_contain_text(f"rank 1 of 2 (node rank 1 of 2) started on {second}")
        page.screenshot(path=shots / "job-gang.png", full_page=True)
    finally:
        headers = {"Authorization": f"Bearer {site.tokens['root']}"}
        httpx.post(f"{site.url}/v1/jobs/{gang}/cancel", headers=headers).raise_for_status()


def test_the_inventory_shows_the_mig_slices_of_a_node_coloured_by_tenant(page, site, shots):
    sign_in(page, site, "alice")
    page.get_by_role("link", name="Inventory").click()
    node = page.locator("article[data-node='mig-01']")
    expect(node).to_be_visible()
    expect(node.locator(".seg", has_text="3g.20gb").first).to_be_visible()
    assert node.locator(".seg").count() >= 9  # seven 1g.5gb and two 3g.20gb instances
    page.screenshot(path=shots / "inventory.png", full_page=True)
    # alice's job holds a 3g.20gb instance in her tenant's colour; bob's is another tenant's.
    expect(node.locator(".seg[data-tenant='vision']")).to_have_count(1)
    expect(node.locator(".seg[data-tenant='(another tenant)']")).to_have_count(1)
    assert "bob" not in page.locator("main").inner_text()
    # Both tiers on one page.
    expect(page.locator("section[data-cluster='k8s-a'] article")).not_to_have_count(0)
    page.screenshot(path=shots / "inventory.png", full_page=True)


def test_a_node_card_says_its_block_and_nvlink_islands(page, site, shots):
    """The demo fleet's gpu-01 has its four GPUs in NVLink pairs; the H100 node of k8s-a has one
    NVSwitch island of eight (the API's gpu_topology and topology)."""
    sign_in(page, site, "alice")
    page.get_by_role("link", name="Inventory").click()
    expect(page.locator("article[data-node='gpu-01'] [data-testid='topology']")).to_have_text(
        "NVLink 0-1 2-3 · PCIe 0-3 · socket 0-1 2-3 · (simulated)"
    )
    expect(
        page.locator("section[data-cluster='k8s-a'] article[data-node='h100'] [data-testid='topology']")
    ).to_have_text("NVLink 0-7 · PCIe 0-1 2-3 4-5 6-7 · socket 0-3 4-7 · (simulated)")
    # A node whose topology nobody reported shows no such line.
    expect(page.locator("article[data-node='mps-01'] [data-testid='topology']")).to_have_count(0)
    expect(page.locator("article[data-node='t4-01'] [data-testid='topology']")).to_have_count(0)
    page.locator("article[data-node='gpu-01']").screenshot(path=shots / "inventory-topology.png")


def test_a_reserved_node_says_until_when_in_the_browsers_time_zone(browser, site):
    """A node held for a waiting multi-node job shows the time in the reader's time zone and
    locale, as every other time on the page (the API gives it in UTC)."""
    context = browser.new_context(viewport={"width": 1400, "height": 900}, timezone_id="Asia/Tokyo", locale="en-GB")
    page = context.new_page()

    def reserve_mig_01(route):  # the API's inventory with mig-01 reserved, in the API's own form
        body = route.fetch().json()
        for cluster in body["clusters"]:
            for node in cluster["nodes"]:
                if node["name"] == "mig-01":
                    node["reserved_for"] = {"job_id": 42, "start_by": "2026-12-07T11:00:00+00:00"}
        route.fulfill(json=body)

    try:
        page.route("**/v1/inventory", reserve_mig_01)
        sign_in(page, site, "alice")
        page.get_by_role("link", name="Inventory").click()
        reserved = page.locator("article[data-node='mig-01'] .reserved")
        expect(reserved).to_have_text(" · reserved for job 42 until ~20:00")  # 11:00 UTC is 20:00 in Tokyo
    finally:
        context.close()


def test_a_user_cancels_their_own_job(page, site):
    victim = site.submit("alice", "--name", "cancel-me", "--kind", "training", "--gpus", "16", "--", "x")
    site.wait_for(victim, "held")
    sign_in(page, site, "alice")
    page.goto(f"{site.url}/#/job/{victim}")
    page.once("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Cancel job").click()
    expect(page.locator("h1 .badge")).to_have_text("cancelled")
    expect(page.get_by_role("status")).to_contain_text("Cancelled")
    assert site.job(victim)["state"] == "cancelled"


def test_tenant_a_sees_none_of_tenant_b_jobs(page, site):
    sign_in(page, site, "alice")
    page.goto(f"{site.url}/#/queue?state=all")
    expect(page.locator(f"tr[data-job='{site.jobs['train']}']")).to_be_visible()
    expect(page.locator(f"tr[data-job='{site.jobs['bob']}']")).to_have_count(0)
    assert "bob-secret-model" not in page.content()
    # Asking for bob's job by id: not found, as the API answers.
    page.goto(f"{site.url}/#/job/{site.jobs['bob']}")
    expect(page.get_by_role("alert")).to_contain_text("no job")
    # A user sees no Admin page.
    expect(page.get_by_role("link", name="Admin")).to_be_hidden()
    # And bob, the other way round.
    sign_in(page, site, "bob")
    page.goto(f"{site.url}/#/queue?state=all")
    expect(page.locator(f"tr[data-job='{site.jobs['bob']}']")).to_be_visible()
    expect(page.locator("tr[data-job]")).to_have_count(1)


def test_markup_in_a_job_is_shown_as_text(page, site):
    # Names are validated; a command is free text, and the job page shows it.
    sign_in(page, site, "alice")
    page.goto(f"{site.url}/#/job/{site.jobs['spare']}")
    expect(page.get_by_test_id("spec")).to_contain_text("<img src=x onerror=alert(1)>")
    expect(page.locator("main img")).to_have_count(0)


def test_an_admin_sees_findings_and_applies_a_policy_after_its_diff(page, site, shots):
    sign_in(page, site, "root")
    page.get_by_role("link", name="Admin").click()
    expect(page.get_by_test_id("clusters")).to_contain_text("slurm-a")
    expect(page.get_by_test_id("findings")).to_contain_text("no agent reports")
    page.get_by_placeholder("job id").fill(str(site.jobs["held"]))
    page.get_by_role("button", name="Explain", exact=True).click()
    expect(page.get_by_test_id("explain")).to_contain_text("rule")
    editor = page.locator("textarea[name=policy]")
    text = editor.input_value()
    editor.fill(text + "\n# reviewed in the dashboard\n")
    apply = page.get_by_role("button", name="Apply")
    expect(apply).to_be_disabled()  # not before the diff was shown
    page.get_by_role("button", name="Check and show the diff").click()
    expect(page.get_by_test_id("diff")).to_contain_text("+# reviewed in the dashboard")
    apply.click()  # no comment yet: it says so, and nothing is applied
    expect(page.get_by_role("alert")).to_contain_text("comment")
    page.get_by_placeholder("why this change").fill("a comment line")
    page.screenshot(path=shots / "admin.png", full_page=True)
    apply.click()
    expect(page.get_by_role("status")).to_contain_text("is active")
    # The page is drawn again: the new version is the active one, and editing goes on from it.
    expect(page.get_by_test_id("policy-history").locator("tr", has_text="a comment line")).to_contain_text("active")
    expect(page.get_by_role("heading", name="Edit (from version 2)")).to_be_visible()
    history = httpx.get(
        f"{site.url}/v1/policy/history", headers={"Authorization": f"Bearer {site.tokens['root']}"}
    ).json()
    assert history[0]["active"] and history[0]["comment"] == "a comment line"


def test_the_tenants_page_shows_share_against_weight(page, site):
    sign_in(page, site, "root")
    page.get_by_role("link", name="Tenants").click()
    table = page.get_by_test_id("tenants")
    expect(table).to_contain_text("vision")
    expect(table).to_contain_text("nlp")


def test_a_user_sees_the_same_shares_as_an_admin_with_other_tenants_unnamed(page, site, shots):
    def shares(user: str) -> dict[str, list[str]]:
        sign_in(page, site, user)
        page.get_by_role("link", name="Tenants").click()
        rows = page.get_by_test_id("tenants").locator("tbody tr")
        expect(rows.first).to_be_visible()
        return {r[0]: r[1:4] for r in (row.split("\t") for row in rows.evaluate_all(TAB_ROWS))}

    admin = shares("root")
    alice = shares("alice")  # tenant vision
    page.screenshot(path=shots / "tenants-user.png", full_page=True)
    assert alice["vision"] == admin["vision"]  # weight, fair share, GPUs held
    assert admin["vision"][1] == "50%" and alice["(other tenants)"][1] == "50%"
    assert "nlp" not in page.get_by_test_id("tenants").inner_text()
    bars = page.get_by_test_id("shares").inner_text()
    assert "(other tenants)" in bars and "100%" not in bars


TAB_ROWS = "rows => rows.map(r => [...r.cells].map(c => c.textContent.trim()).join('\\t'))"


# Every word of a table cell (split at spaces and hyphens, where a line may break; a
# name whole) whose glyphs land on more than one line: a word broken mid-word.
BROKEN_WORDS = """() => {
  const broken = [];
  for (const td of document.querySelectorAll("main td")) {
    const walker = document.createTreeWalker(td, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      // A name (class token: slurm-a, bob-secret-model) is one word, hyphens and all.
      const words = td.classList.contains("token") ? /\\S.*\\S|\\S/g : /[^\\s-]+/g;
      for (const m of node.data.matchAll(words)) {
        const range = document.createRange();
        range.setStart(node, m.index);
        range.setEnd(node, m.index + m[0].length);
        const lines = new Set([...range.getClientRects()].filter((r) => r.width > 0).map((r) => Math.round(r.top)));
        if (lines.size > 1) broken.push(m[0]);
      }
    }
  }
  return broken;
}"""


def test_no_table_cell_breaks_a_word_at_1000_px_and_wide_tables_scroll(browser, site, shots):
    context = browser.new_context(viewport={"width": 1000, "height": 800})
    page = context.new_page()
    try:
        sign_in(page, site, "root")
        for view, table in (("queue?state=all", "jobs"), ("tenants", "tenants"), ("admin", "findings")):
            page.goto(f"{site.url}/#/{view}")
            expect(page.get_by_test_id(table).locator("tbody tr").first).to_be_visible()
            page.screenshot(path=shots / f"narrow-{view.split('?')[0]}.png", full_page=True)
            assert page.evaluate(BROKEN_WORDS) == [], view
            # Each header row sits above the first row (it stuck 49 px down, over the rows).
            head, first = (page.get_by_test_id(table).locator(part).first.bounding_box() for part in ("th", "tbody tr"))
            assert head["y"] + head["height"] <= first["y"] + 1, view
            # The page never scrolls sideways: a table wider than the page scrolls in its box.
            assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth"), view
    finally:
        context.close()


def test_the_page_calls_nothing_outside_the_broker(page, site):
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    sign_in(page, site, "root")
    for view in ("queue", "inventory", "tenants", "admin"):
        page.goto(f"{site.url}/#/{view}")
        page.wait_for_load_state("networkidle")
    outside = [u for u in requests if not u.startswith(site.url)]
    assert outside == []
    response = httpx.get(site.url + "/", headers={"Accept": "text/html"})
    assert "script-src 'self'" in response.headers["content-security-policy"]
    assert not re.search(r"https?://", response.text)
    index = json.loads(httpx.get(site.url + "/").text)  # not a browser: the JSON index, as before
    assert index["docs"] == "/docs"


def test_an_admin_follows_mig_changes_and_node_moves_step_by_step(page, site, shots):
    """The Admin page lists MIG changes and node moves with their steps (rows written as the
    broker writes them; the steps themselves are tested in integration/test_slurm_mig.py and
    integration/test_lending.py)."""
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import create_engine
    from sqlalchemy.orm import Session

    from broker.core.models import MigChange, MigChangeEvent, NodeMove, NodeMoveEvent

    at = datetime.now(UTC) - timedelta(minutes=5)
    engine = create_engine(site.database_url)
    with Session(engine) as session, session.begin():
        change = MigChange(
            cluster="slurm-a", node="mig-01", gpu=0, model="A100-SXM4-40GB", from_layout=["3g.20gb@0", "3g.20gb@4"],
            to_layout=["2g.10gb@0", "2g.10gb@2", "3g.20gb@4"], target=["2g.10gb@0", "2g.10gb@2", "3g.20gb@4"],
            step="done", rolling_back=False, changed_by="agent", reason="2 waiting 2g.10gb jobs", requested_by="root",
            created_at=at, step_at=at,
            ended_at=at + timedelta(minutes=2),
        )  # fmt: skip
        move = NodeMove(
            node="lend-01", source="slurm-a", target="k8s-a", step="joining", reason="4 GPU-eq wait for k8s-a",
            created_at=at, step_at=at,
        )  # fmt: skip
        session.add_all([change, move])
        session.flush()
        for step, note in (("planned", "asked by root"), ("emptying", "draining mig-01"), ("done", "<b>new</b>")):
            session.add(MigChangeEvent(change_id=change.id, at=at, step=step, note=note))
        session.add(NodeMoveEvent(move_id=move.id, at=at, step="draining", note="fenced on slurm-a"))
    engine.dispose()
    sign_in(page, site, "root")
    page.get_by_role("link", name="Admin").click()
    changes = page.get_by_test_id("mig-changes")
    expect(changes).to_contain_text("mig-01 / GPU 0")
    expect(changes).to_contain_text("3g.20gb@0, 3g.20gb@4 → 2g.10gb@0, 2g.10gb@2, 3g.20gb@4")
    expect(changes).to_contain_text("<b>new</b>")  # a note is text, never markup
    expect(page.get_by_test_id("node-moves")).to_contain_text("slurm-a → k8s-a")
    page.get_by_text("Every step").click()
    events = page.get_by_test_id("fleet-events")
    expect(events).to_contain_text("MIG 1 emptying")
    expect(events).to_contain_text("fenced on slurm-a")
    page.screenshot(path=shots / "admin-mig.png", full_page=True)
    expect(page.locator("main")).not_to_contain_text("null")  # nothing left out is drawn as "null"
