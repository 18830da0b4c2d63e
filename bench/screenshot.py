"""The README screenshots: the demo app, trained vs identity, on the test query where they disagree
most (Search tab), and the Compare tab on the whole test split.

  python bench/screenshot.py [--index artifacts/demo/index] [--out docs/app.png] [--compare docs/compare.png]
                             [--why docs/why.png]

The third: the Search tab with a result's "why" panel open, identity (left) against trained (right).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from common import free_port


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--index", default="artifacts/demo/index", help="the index the app serves (default: %(default)s)")
    ap.add_argument("--out", default="docs/app.png", help="Search-tab screenshot (default: %(default)s)")
    ap.add_argument("--compare", default="docs/compare.png",
                    help="Compare-tab screenshot, trained vs identity (default: %(default)s)")
    ap.add_argument("--why", default="docs/why.png",
                    help="Search tab with a result's why panel open, identity vs trained (default: %(default)s)")
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright

    from app.cli import build_parser, launch

    port = free_port()
    demo, svc = launch(build_parser().parse_args(["--index", args.index, "--port", str(port)]), block=False)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path="/usr/bin/chromium", args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        page = b.new_page(viewport={"width": 1500, "height": 1000})
        page.goto(f"http://127.0.0.1:{port}/", wait_until="load")
        page.wait_for_selector("button.thumbnail-item", timeout=120000)
        page.get_by_text("Disagreements: test queries").click()
        page.get_by_role("button", name="Find disagreements for the current configurations").click()
        page.get_by_text("test queries with the largest AP change").wait_for(timeout=180000)
        thumbs = page.locator("button.thumbnail-item")
        n_examples = len(svc.examples())
        thumbs.nth(n_examples).wait_for(timeout=30000)
        thumbs.nth(n_examples).click()  # before any search, the disagreement thumbnails follow the examples
        page.get_by_text("Query class:").wait_for(timeout=60000)
        page.wait_for_timeout(2500)
        page.screenshot(path=args.out, full_page=True)
        page.goto(f"http://127.0.0.1:{port}/?q=0&strategy=identity&mode=cosine", wait_until="load")
        page.get_by_text("Right: identity · cosine").first.wait_for(timeout=120000)
        page.get_by_role("tab", name="Compare").click()
        page.locator("#cmp-scatter circle[data-id]").first.wait_for(timeout=180000)
        page.wait_for_timeout(4000)  # the two maps render after the scatter
        page.screenshot(path=args.compare, full_page=True)
        # identity on the left, trained on the right: why did the right panel's second result move?
        q = int(svc.data.items.ids[0])
        page.goto(f"http://127.0.0.1:{port}/?q={q}&left_strategy=identity&left_mode=cosine&strategy=trained"
                  "&mode=cosine&k=8", wait_until="load")
        page.get_by_text("Left: identity · cosine").first.wait_for(timeout=120000)
        page.locator("#right-results button.thumbnail-item").nth(1).wait_for(timeout=120000)
        page.locator("#right-results button.thumbnail-item").nth(1).click()
        page.locator("#why").get_by_text("score difference (right − left)").wait_for(timeout=120000)
        page.wait_for_timeout(2500)
        page.screenshot(path=args.why, full_page=True)
        b.close()
    demo.close()
    print("wrote", args.out, args.compare, args.why)


if __name__ == "__main__":
    main()
