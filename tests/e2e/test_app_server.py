"""The running app: the /search API through gradio_client, what it serves, and a real browser."""
import json
import os
import shutil
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from app_helpers import chromium_path, free_port, needs_chromium
from support import BYTECODE, PRODUCT, ROOT, run_command

from index.backends.gallery import HIT_FIELDS

# a served app (threads, sockets) and app subprocesses: make test-fast leaves these out
pytestmark = pytest.mark.multiprocess




def test_gradio_overheads_are_bounded(server):
    """The settings reach Gradio: its event-log summary is not recomputed per search, and the
    sessions stateless API calls open are capped (bench/serving_costs.py measures both); the
    re-rankers' sizes are bounded by the server's default limit."""
    from app.cli import GRADIO_SUMMARY_EVERY, SESSIONS
    from app.limits import DEFAULT_MAX_RERANK_SIZE

    _, svc, _ = server
    demo = svc.demo
    assert demo._queue.ANAYLTICS_CACHE_FREQUENCY == GRADIO_SUMMARY_EVERY
    assert demo.state_holder.capacity == SESSIONS < 10000
    assert svc.max_rerank_size == DEFAULT_MAX_RERANK_SIZE


def test_threads_default_to_a_share_of_the_cores(tmp_path):
    from app.cli import build_parser, serving_thread_count

    assert build_parser().parse_args([]).threads is None  # resolved at launch from --concurrency
    assert build_parser().parse_args(["--threads", "3"]).threads == 3
    assert serving_thread_count(1) == len(os.sched_getaffinity(0))
    assert serving_thread_count(len(os.sched_getaffinity(0)) + 1) == 1  # never 0 (= the libraries' own setting)
    r = run_command("app", "--concurrency", "0", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].endswith("--concurrency must be ≥ 1, got 0")


def listening_addresses(port: int) -> set[str]:
    """Local addresses with a socket listening on `port` (from /proc/net/tcp and tcp6)."""
    out = set()
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(f).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.split(":")
            if int(p, 16) == port and state == "0A":  # LISTEN
                out.add(addr)
    return out


def test_binds_loopback_only(server):
    _, _, port = server
    addrs = listening_addresses(port)
    assert addrs == {"0100007F"}, addrs  # 127.0.0.1 only, not 0.0.0.0 or ::


def assert_same_results(api: list[dict], cli: list[dict]) -> None:
    """Identical fields and values (scores to float tolerance: they crossed JSON differently); the
    app's results say besides whether each has an image."""
    assert all(x["has_image"] is True for x in api)
    api = [{k: v for k, v in x.items() if k != "has_image"} for x in api]
    assert [list(x) for x in api] == [list(x) for x in cli] == [list(HIT_FIELDS)] * len(cli)
    strip = [[{k: v for k, v in x.items() if k != "score"} for x in rs] for rs in (api, cli)]
    assert strip[0] == strip[1] and len(cli) > 0
    assert [x["score"] for x in api] == pytest.approx([x["score"] for x in cli], rel=1e-5)


def test_api_search_matches_cli(server, tmp_path, monkeypatch):
    from gradio_client import Client, handle_file
    from gradio_client.exceptions import AppError

    from app.service import SearchConfig

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # a re-ranker's caches, if it keeps any
    url, svc, _ = server
    img = svc.root / svc.data.items.paths[7]
    client = Client(url, verbose=False)
    api = client.view_api(print_info=False, return_format="dict")["named_endpoints"]["/search"]
    # the stable positional order docs/app-and-compare.md documents: every parameter added later comes last
    assert [p["parameter_name"] for p in api["parameters"]] == ["image", "strategy", "r", "seed", "alpha", "p",
                                                                  "mode", "k", "psd", "rerank", "rerank_params"]
    reranked = client.predict(handle_file(str(img)), "random", 0.4, 2, 0.5, 0.5, "bilinear", 6, "abs", "aqe",
                              "n=3, alpha=1", api_name="/search")
    want = svc.panel(svc.query_from_upload(str(img)), SearchConfig("random", {"r": 0.4, "seed": 2}, "bilinear", "aqe",
                                                           {"n": 3, "alpha": 1.0}), 6)
    assert reranked["metric"] == want.title and [r["id"] for r in reranked["results"]] == [r["id"] for r in
                                                                                            want.results]
    with pytest.raises(AppError, match="nope is not in the list of choices"):  # the dropdown's, as for a strategy
        client.predict(handle_file(str(img)), "trained", 0.5, 0, 0.5, 0.5, "cosine", 3, "abs", "nope", "",
                       api_name="/search")
    # a script written before `psd` existed: image, strategy, r, seed, alpha, p, mode, k
    res = client.predict(handle_file(str(img)), "random", 0.4, 2, 0.5, 0.5, "bilinear", 6, api_name="/search")
    out = tmp_path / "cli.json"
    r = run_command("index", "search", "--index", str(svc.index_dir), "--image",
                    str(img), "--strategy", "random", "--r", "0.4", "--seed", "2", "--k", "6", "--mode", "bilinear",
                    "--json", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    cli = json.loads(out.read_text())["queries"][0]["results"]
    assert_same_results(res["results"], cli)
    by_name = client.predict(image=handle_file(str(img)), strategy="random", r=0.4, seed=2, mode="bilinear", k=6,
                             api_name="/search")  # as docs/app-and-compare.md calls it
    assert by_name == res
    # the defaults agree too: the trained metric, as evaluated everywhere (cosine)
    res = client.predict(handle_file(str(img)), api_name="/search")
    r = run_command("index", "search", "--index", str(svc.index_dir), "--image", str(img), "--json", str(out),
                    cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    cli = json.loads(out.read_text())
    assert cli["strategy"] == "trained" and cli["mode"] == "cosine" and res["metric"].endswith("cosine")
    assert_same_results(res["results"], cli["queries"][0]["results"])
    # a bad upload is an error for that call; the app keeps serving
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    with pytest.raises(AppError, match="not a usable image"):
        client.predict(handle_file(str(bad)), "identity", 0.5, 0, 0.5, 0.5, "bilinear", 3, api_name="/search")
    again = client.predict(handle_file(str(img)), "identity", 0.5, 0, 0.5, 0.5, "cosine", 3, api_name="/search")
    assert len(again["results"]) == 3


def test_rest_search_matches_cli_and_refuses_bad_input(server, tmp_path):
    """POST /api/search (one multipart request) answers with the CLI's results; bad input is a
    4xx with a one-line error, and the app keeps serving."""
    import httpx

    url, svc, _ = server
    img = svc.root / svc.data.items.paths[7]
    api = url + "api/search"
    fields = {"strategy": "random", "r": "0.4", "seed": "2", "mode": "bilinear", "k": "6"}
    r = httpx.post(api, files={"image": img.read_bytes()}, data=fields, timeout=60)
    assert r.status_code == 200, r.text
    out = tmp_path / "cli.json"
    c = run_command("index", "search", "--index", str(svc.index_dir), "--image", str(img), "--strategy", "random",
                    "--r", "0.4", "--seed", "2", "--k", "6", "--mode", "bilinear", "--json", str(out), cwd=tmp_path)
    assert c.returncode == 0, c.stderr
    assert_same_results(r.json()["results"], json.loads(out.read_text())["queries"][0]["results"])
    assert r.json()["metric"] == "random(r=0.4, seed=2) · bilinear"
    # defaults: trained, cosine, k = 10 (capped by the index size)
    d = httpx.post(api, files={"image": img.read_bytes()}, timeout=60).json()
    assert d["metric"] == "trained · cosine" and len(d["results"]) == min(10, svc.data.manifest["count"])

    bad_png = b"\x89PNG\r\n\x1a\n truncated"
    cases = [({}, {"strategy": "trained"}, 400, "no image"),
             ({"image": bad_png}, {}, 400, "not a usable image"),
             ({"image": img.read_bytes()}, {"strategy": "nope"}, 400, "unknown strategy"),
             ({"image": img.read_bytes()}, {"strategy": "custom"}, 400, "unknown strategy"),  # needs a file
             ({"image": img.read_bytes()}, {"strategy": "random", "r": "abc"}, 400, "r"),
             ({"image": img.read_bytes()}, {"mode": "sideways"}, 400, "mode"),
             ({"image": img.read_bytes()}, {"k": "0"}, 400, "k must"),
             ({"image": img.read_bytes()}, {"k": "ten"}, 400, "k must"),
             ({"image": img.read_bytes()}, {"stratgy": "identity"}, 400, "unknown field 'stratgy'; valid: image,"),
             ({"image": img.read_bytes()}, {"rerank": "aqe", "rerank_params": f"n={svc.max_rerank_size + 1}"}, 400,
              "(this server's limit)"),
             ({"image": b"\0" * (11 * 1024 * 1024)}, {}, 413, "too large")]  # the app's default cap: 10 MB
    for files, data, status, msg in cases:
        e = httpx.post(api, files=files or None, data=data, timeout=60)
        assert e.status_code == status, (data, e.status_code, e.text)
        assert msg in e.json()["error"] and "\n" not in e.json()["error"], e.json()
    assert httpx.get(api, timeout=30).status_code == 405
    assert httpx.post(api, files={"image": img.read_bytes()}, data={"k": "3"}, timeout=60).status_code == 200


def test_serves_no_arbitrary_files(server):
    url, svc, _ = server
    gallery_file = (svc.root / svc.data.items.paths[0]).resolve()
    for target in (str(ROOT / "README.md"), "/etc/passwd", str(gallery_file), "../../etc/passwd"):
        for prefix in ("gradio_api/file=", "file="):
            try:
                with urllib.request.urlopen(url + prefix + target, timeout=10) as resp:
                    body = resp.read()
                    assert resp.status != 200 or b"root:" not in body and len(body) < 100, (prefix, target)
            except urllib.error.HTTPError as e:
                assert e.code in (403, 404), (prefix, target, e.code)




@pytest.mark.browser
@needs_chromium
def test_real_browser_upload_search_switch(server, tmp_path):
    from playwright.sync_api import sync_playwright

    url, svc, _ = server
    img = svc.root / svc.data.items.paths[9]
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url, wait_until="load")
            page.wait_for_selector("input[type=file]", state="attached", timeout=60000)
            page.locator("input[type=file]").first.set_input_files(str(img))
            left_title = page.get_by_text("Left: trained")
            left_title.first.wait_for(timeout=30000)
            right = page.get_by_text("Right: identity")
            right.first.wait_for(timeout=30000)
            left_before = page.locator(".result-gallery").first.inner_text()
            assert "✓" not in left_before  # an upload's class is unknown: no marks
            # switch the right-panel strategy
            page.get_by_label("Right strategy").click()
            page.get_by_role("option", name="spectral").click()
            page.get_by_text("Right: spectral").first.wait_for(timeout=30000)
            galleries = page.locator(".result-gallery")
            assert galleries.count() == 2
            thumbs = [galleries.nth(i).locator("button.thumbnail-item").count() for i in range(2)]
            assert thumbs == [12, 12], thumbs
            page.screenshot(path=str(tmp_path / "app_browser.png"), full_page=True)
        finally:
            browser.close()
    assert (tmp_path / "app_browser.png").stat().st_size > 10_000


def test_second_index_is_served_beside_the_first_and_each_links_to_the_other(tiny_index, tmp_path):
    """`--second-index`: both indexes answer /api/search on their own port, each page's header links to the
    other, and a missing second index is refused before anything is served."""
    from app.cli import build_parser, launch
    from core.errors import UserError

    port = free_port()
    while True:  # two free neighbouring ports
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                break
            except OSError:
                port = free_port()
    second = tmp_path / "second"
    shutil.copytree(tiny_index, second)
    with pytest.raises(UserError, match="second-index"):
        launch(build_parser().parse_args(["--index", str(tiny_index), "--second-index", str(tmp_path / "nope"),
                                          "--port", str(port)]), block=False)
    demo, svc = launch(build_parser().parse_args(["--index", str(tiny_index), "--label", "neck trained",
                                                  "--second-index", str(second), "--second-label", "neck at init",
                                                  "--port", str(port), "--threads", "1"]), block=False)
    try:
        assert len(demo.companions) == 1
        for p, other in ((port, port + 1), (port + 1, port)):
            page = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{p}/config", timeout=30).read())
            header = next(c["props"]["value"] for c in page["components"]
                          if c.get("props", {}).get("elem_id") == "index-header")
            assert f"http://127.0.0.1:{other}/" in header and "tr(M*)" in header
        img = next(Path(svc.root).rglob("*.png"))
        for p in (port, port + 1):
            boundary = "xyz"
            body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"q.png\"\r\n"
                    "Content-Type: image/png\r\n\r\n").encode() + img.read_bytes() + f"\r\n--{boundary}--\r\n".encode()
            req = urllib.request.Request(f"http://127.0.0.1:{p}/api/search", data=body,
                                         headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
            assert len(json.loads(urllib.request.urlopen(req, timeout=60).read())["results"]) == 10
    finally:
        for page in (demo, *demo.companions):
            page.close()


def test_starting_the_app_writes_nothing_into_the_source_tree(tiny_index, tmp_path):
    """Importing app.ui and serving an index leaves the checkout as it was, ignored files included
    (Gradio writes a .pyi stub beside any module that subclasses one of its components)."""
    def tree() -> set:  # the code the app runs, and the checkout's top level
        out = {p.name for p in ROOT.iterdir()}
        for pkg in ("app", "core", "data", "evaluation", "index", "model"):
            for dirpath, _, filenames in os.walk(ROOT / pkg):
                out |= {str(Path(dirpath, f).relative_to(ROOT)) for f in filenames}
        return out

    before = tree()
    # `python -m app --help` (the CLI's import path), then the app served, in one process
    code = ("import contextlib, io, runpy, sys\n"
            "sys.argv = ['app', '--help']\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    try:\n"
            "        runpy.run_module('app', run_name='__main__', alter_sys=True)\n"
            "    except SystemExit as e:\n"
            "        assert e.code in (0, None), e.code\n"
            "from app.cli import build_parser, launch\n"
            f"demo, _ = launch(build_parser().parse_args(['--index', {str(tiny_index)!r}, '--port', "
            f"'{free_port()}', '--threads', '1']), block=False)\n"
            "demo.close()\n")
    import subprocess
    import sys
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(PRODUCT), "HOME": str(tmp_path),
           "GRADIO_ANALYTICS_ENABLED": "False", "NO_PROXY": "127.0.0.1,localhost"} | BYTECODE
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert tree() - before == set()


def test_the_app_serves_an_ondisk_ivf_with_the_index_search_flags(tiny_index, tmp_path):
    """`python -m app --backend ondisk --ivf DIR --nprobe N`: the page names the backend and
    POST /api/search answers as `index search --backend ondisk` with the same flags does."""
    import httpx

    from app.cli import build_parser, launch
    from index.backends.ondisk import build_for_index

    # the default cosine lists (trained, identity) and those of the search below
    ivf = build_for_index(tiny_index, tmp_path / "ivf", nlist=2,
                          cosine_for=(("trained", {}), ("identity", {}), ("spectral", {"p": 0.5})))
    port = free_port()
    demo, svc = launch(build_parser().parse_args(["--backend", "ondisk", "--ivf", str(ivf), "--nprobe", "1",
                                                  "--port", str(port), "--threads", "1"]), block=False)
    try:
        page = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/config", timeout=30).read())
        header = next(c["props"]["value"] for c in page["components"]
                      if c.get("props", {}).get("elem_id") == "index-header")
        assert "an on-disk IVF" in header and svc.backend == "ondisk" and svc.gallery.nprobe == 1
        img = svc.root / svc.data.items.paths[7]
        r = httpx.post(f"http://127.0.0.1:{port}/api/search", files={"image": img.read_bytes()},
                       data={"strategy": "spectral", "p": "0.5", "k": "5"}, timeout=60)
        assert r.status_code == 200, r.text
        out = tmp_path / "cli.json"
        c = run_command("index", "search", "--backend", "ondisk", "--ivf", str(ivf), "--nprobe", "1", "--image",
                        str(img), "--strategy", "spectral", "--p", "0.5", "--k", "5", "--json", str(out), cwd=tmp_path)
        assert c.returncode == 0, c.stderr
        assert_same_results(r.json()["results"], json.loads(out.read_text())["queries"][0]["results"])
    finally:
        demo.close()
