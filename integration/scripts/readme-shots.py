"""The README's dashboard screenshots, taken from the demo fleet: run `make demo`, then

    LINK=$(.venv/bin/gpush dashboard --json | jq -r .login_link)
    .venv/bin/python integration/scripts/readme-shots.py "$LINK" docs/img

(queue.png and inventory.png; Debian's chromium driven by Playwright, 1280 px wide)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from playwright.sync_api import sync_playwright


def main(link: str, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    base = link.split("#")[0]
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=shutil.which("chromium") or "/usr/bin/chromium", args=["--no-sandbox"]
        )
        page = browser.new_page(viewport={"width": 1280, "height": 760})
        page.goto(link)
        page.wait_for_selector("[data-testid=jobs] tbody tr")
        page.wait_for_selector("[data-testid=state-tabs] a")
        page.screenshot(path=out / "queue.png")
        page.goto(base + "#/inventory")
        page.wait_for_selector("article[data-node]")
        page.screenshot(path=out / "inventory.png", full_page=True)
        browser.close()
    print(f"wrote {out / 'queue.png'} and {out / 'inventory.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], Path(sys.argv[2])))
