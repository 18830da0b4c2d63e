"""A real browser on the Search and Compare tabs: a shared link opens its comparison, a click on a
point opens that query; a non-trained left side chosen in the page drives both tabs, and a click
on a result opens the why panel."""
import re
from contextlib import contextmanager

import pytest
from app_helpers import chromium_path, needs_chromium

pytestmark = [pytest.mark.browser, pytest.mark.multiprocess]


def launch_chromium(p):
    return p.chromium.launch(executable_path=chromium_path(), args=[
        "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"])


@pytest.fixture(scope="module")
def chromium():
    """One headless Chromium for the module's tests, closed at the module's end: launching it costs
    seconds, a fresh browser context (no cookies, storage or cache of another test's) far less."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = launch_chromium(p)
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def browser_page(browser, width: int, height: int):
    """A page in a fresh context of `browser`, which is closed however the test ends."""
    context = browser.new_context(viewport={"width": width, "height": height})
    try:
        yield context.new_page()
    finally:
        context.close()


def wait_for_link(page, item_id: int):
    """The share box names the query once both panels are filled."""
    page.wait_for_function("(q) => (document.querySelector('#share-link textarea, #share-link input') || {}).value"
                           "?.includes('?q=' + q + '&')", arg=item_id, timeout=60000)


@needs_chromium
def test_shared_link_then_click_a_point(server, chromium, tmp_path):
    url, svc, _ = server
    shared = int(svc.data.items.ids[5])
    with browser_page(chromium, 1400, 1100) as page:
        page.goto(f"{url}?q={shared}&strategy=spectral&p=0.5&mode=cosine&k=6", wait_until="load")
        page.get_by_text("Right: spectral(p=0.5) · cosine").first.wait_for(timeout=60000)
        page.get_by_text("Left: trained · cosine").first.wait_for(timeout=30000)
        wait_for_link(page, shared)
        galleries = page.locator(".result-gallery")
        assert [galleries.nth(i).locator("button.thumbnail-item").count() for i in range(2)] == [6, 6]
        assert "Query class: **" not in page.content()  # rendered as bold text, not markdown
        page.get_by_role("tab", name="Compare").click()
        points = page.locator("#cmp-scatter circle[data-id]")
        points.first.wait_for(timeout=60000)
        assert points.count() == len(svc.data.items)
        assert page.locator("#cmp-scatter text", has_text="★").count() == 1  # the shared query is marked
        page.screenshot(path=str(tmp_path / "compare_tab.png"), full_page=True)
        # the topmost point (drawn last) other than the query's: points with equal APs overlap
        ids = [int(i) for i in points.evaluate_all("cs => cs.map(c => c.dataset.id)")]
        target = next(i for i in reversed(ids) if i != shared)
        page.locator(f'#cmp-scatter circle[data-id="{target}"]').click()
        wait_for_link(page, target)  # the Search tab, searched with the clicked query
        assert page.get_by_text("Right: spectral(p=0.5) · cosine").first.is_visible()
        assert page.locator(".result-gallery").first.is_visible()
        page.screenshot(path=str(tmp_path / "after_click.png"), full_page=True)
    assert (tmp_path / "compare_tab.png").stat().st_size > 10_000


def choose(page, elem_id: str, option: str):
    """Pick `option` in the Gradio dropdown `elem_id` (its options appear on focus)."""
    page.locator(f"#{elem_id} input").click()
    page.get_by_role("option", name=option, exact=True).click()


def visible_controls(page, name: str) -> int:
    """How many parameter controls labelled `name: …` are shown (one per panel at most)."""
    return page.get_by_text(re.compile(rf"^{name}: ")).filter(visible=True).count()


@needs_chromium
def test_two_configurations_and_the_why_panel(server, chromium, tmp_path):
    url, svc, _ = server
    q = int(svc.data.items.ids[9])
    with browser_page(chromium, 1500, 1300) as page:
        # an old link (right side only): trained on the left
        page.goto(f"{url}?q={q}&strategy=spectral&p=0.5&mode=cosine&k=6", wait_until="load")
        page.get_by_text("Left: trained · cosine").first.wait_for(timeout=60000)
        wait_for_link(page, q)
        assert visible_controls(page, "alpha") == 0 and visible_controls(page, "p") == 1  # spectral's own
        # a non-trained left side, chosen in the page: its parameters appear, both panels search
        choose(page, "left-strategy", "shrink")
        page.get_by_text("Left: shrink(alpha=0.5) · cosine").first.wait_for(timeout=60000)
        page.wait_for_function("() => (document.querySelector('#share-link textarea, #share-link input') || {})"
                               ".value?.includes('left_strategy=shrink')", timeout=60000)
        assert visible_controls(page, "alpha") == 1 and visible_controls(page, "r") == 0
        assert page.get_by_text("Right: spectral(p=0.5) · cosine").first.is_visible()
        # why did the right panel's third result move?
        page.locator("#right-results button.thumbnail-item").nth(2).click()
        why = page.locator("#why")
        why.get_by_text("score difference (right − left)").wait_for(timeout=60000)
        assert why.locator("svg.why-bars rect").count() >= 3
        assert why.locator(".why-strip").count() >= 1 and "rank" in why.inner_text()
        page.screenshot(path=str(tmp_path / "why.png"), full_page=True)
        # the Compare tab compares the two configurations, its scatter coloured by top-k overlap
        page.get_by_role("tab", name="Compare").click()
        points = page.locator("#cmp-scatter circle[data-id]")
        points.first.wait_for(timeout=60000)
        page.get_by_text("shrink(alpha=0.5) · cosine (x) vs spectral(p=0.5) · cosine (y)").wait_for(timeout=30000)
        page.locator("#cmp-colour").get_by_text("Jaccard@k").click()
        page.locator("#cmp-scatter text", has_text="colour: Jaccard@6").wait_for(timeout=30000)
        assert points.count() == len(svc.data.items)
        page.screenshot(path=str(tmp_path / "compare_two.png"), full_page=True)
    assert (tmp_path / "why.png").stat().st_size > 10_000


@needs_chromium
def test_a_reranker_per_panel(server, chromium, tmp_path, monkeypatch):
    """A link's re-ranker opens with its parameters shown; one chosen in the page searches that panel,
    goes into the link, the why panel and the Compare tab."""
    from index.rerankers import RERANKERS

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # dba's offline cache: not the user's
    url, svc, _ = server
    q = int(svc.data.items.ids[11])
    with browser_page(chromium, 1500, 1400) as page:
        page.goto(f"{url}?q={q}&strategy=identity&mode=cosine&rerank=aqe&rerank_n=3&k=6", wait_until="load")
        page.get_by_text("Right: identity · cosine · aqe(n=3, alpha=3.0)").first.wait_for(timeout=60000)
        wait_for_link(page, q)
        assert visible_controls(page, "n") == 1 and visible_controls(page, "k1") == 0  # aqe's own, one panel
        # the left panel's re-ranker, chosen in the page
        doc = RERANKERS.get("dba").doc.split(":")[0]
        choose(page, "left-rerank", f"dba — {doc}")
        page.get_by_text("Left: trained · cosine · dba(n=2, alpha=3.0)").first.wait_for(timeout=60000)
        page.wait_for_function("() => (document.querySelector('#share-link textarea, #share-link input') || {})"
                               ".value?.includes('left_rerank=dba')", timeout=60000)
        assert visible_controls(page, "n") == 2  # dba's on the left, aqe's on the right
        page.locator("#right-results button.thumbnail-item").nth(1).click()
        why = page.locator("#why")
        why.get_by_text("does not apply", exact=False).first.wait_for(timeout=60000)
        assert why.locator(".why-support").count() == 2 and why.locator(".why-strip").count() == 0
        page.screenshot(path=str(tmp_path / "why_rerank.png"), full_page=True)
        page.get_by_role("tab", name="Compare").click()
        page.get_by_text("trained · cosine · dba(n=2, alpha=3.0) (x) vs identity · cosine · aqe(n=3, alpha=3.0) "
                         "(y)").wait_for(timeout=120000)
        assert page.locator("#cmp-scatter circle[data-id]").count() == len(svc.data.items)
    assert (tmp_path / "why_rerank.png").stat().st_size > 10_000


@needs_chromium
def test_above_the_size_the_compare_tab_reads_a_seeded_sample(tiny_index, chromium, tmp_path):
    """`--compare-all-up-to` below the gallery's size: the Compare tab shows its seed and sample size,
    both settable, and its summary names the sample and the bootstrap intervals."""
    from app_helpers import free_port

    from app.cli import build_parser, launch

    port = free_port()
    demo, svc = launch(build_parser().parse_args(["--index", str(tiny_index), "--port", str(port), "--threads", "1",
                                                  "--compare-all-up-to", "10", "--compare-sample", "8"]),
                       block=False)
    try:
        with browser_page(chromium, 1400, 1100) as page:
            page.goto(f"http://127.0.0.1:{port}/", wait_until="load")
            page.get_by_role("tab", name="Compare").click()
            summary = page.locator("#cmp-summary")
            summary.get_by_text(re.compile(r"sample of 8 of \d+ queries \(seed 0\)")).wait_for(timeout=60000)
            assert "bootstrap 95% intervals" in summary.inner_text()
            assert page.locator("#cmp-scatter circle[data-id]").count() == 8
            page.locator("#cmp-seed input").fill("5")
            page.locator("#cmp-sample input").fill("6")
            page.get_by_role("button", name="Compare on a sample of the test queries").click()
            summary.get_by_text(re.compile(r"sample of 6 of \d+ queries \(seed 5\)")).wait_for(timeout=60000)
            page.screenshot(path=str(tmp_path / "sampled_compare.png"), full_page=True)
    finally:
        demo.close()
