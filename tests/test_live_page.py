"""The live page the master serves at /ui, in a real browser (Debian's chromium, headless,
driven by Playwright) against a live job whose workers are real processes: what a person sees
(the job, its state, its progress, the charts, each slot's attempts with their exit causes, the
recoveries), that it updates while the job runs, and that without the right token it shows no
data. The page runs under its own CSP (no inline script but its own, no eval), so the test waits
with Playwright's locator assertions, which evaluate no strings in the page. Screenshots are kept
beside the test's files."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil

import httpx
import pytest
from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import expect

from conftest import SLOW_MODEL

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright

    assert os.path.exists(CHROMIUM), "Debian's chromium is needed: apt-get install -y chromium"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        yield browser
        browser.close()


def csp_refusals(page) -> list[str]:
    """What the page's CSP refuses from now on, as the browser reports it."""
    refused = []
    page.on("console", lambda m: refused.append(m.text) if "Content Security Policy" in m.text else None)
    return refused


def test_the_live_page_shows_the_job_and_follows_it_while_it_runs(digits, start_job, browser, tmp_path):
    job = start_job("--data", digits, "--workers", "2:3", "--epochs", "4", "--model-def", SLOW_MODEL,
                    "--minibatch-size", "16", "--minibatches-per-task", "2", "--checkpoint-steps", "25")
    status = job.wait_for(lambda s: s["world_size"] == 3 and s["step"] > 5, timeout=300)
    with open(os.path.join(job.job_dir, "master.json")) as f:
        url = json.load(f)["url"]
    with open(os.path.join(job.job_dir, "view-token")) as f:
        view_token = f.read().strip()
    shots = tmp_path / "screenshots"
    shots.mkdir()

    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    failed_requests = []
    refused = csp_refusals(page)
    page.on("requestfailed", lambda r: failed_requests.append(r.url))
    page.goto(f"{url}/ui#token={view_token}")
    expect(page.locator("#state")).to_have_text("running", timeout=30_000)
    assert page.locator("#job").inner_text() == "job"
    assert page.locator("#world").inner_text() == "3 / 3"
    rows_before = page.locator("#rows").inner_text()
    assert re.match(r"^\d+ / \d+$", rows_before)
    for chart in ("#loss-chart", "#sps-chart", "#world-chart"):
        page.wait_for_selector(f"{chart} path.series", state="attached", timeout=30_000)
    attempts = page.locator("#timeline g.attempt")
    assert sorted(attempts.nth(i).get_attribute("data-worker") for i in range(attempts.count())) == ["w0.1", "w1.1", "w2.1"]
    page.screenshot(path=str(shots / "1-running.png"), full_page=True)

    # It follows the job: a worker killed now is a bar ended by its cause, its relaunch a new bar
    # in the same slot, and the regroup's recovery a row of its own.
    victim = job.kill_worker(job.status(), rank=1)
    slot = victim["slot"]
    page.wait_for_selector(f"#timeline g.attempt[data-worker='w{slot}.1'] text:text-matches('killed by SIGKILL')", state="attached", timeout=60_000)
    page.wait_for_selector(f"#timeline g.attempt[data-worker='w{slot}.2']", state="attached", timeout=60_000)
    expect(page.locator("#recoveries tbody tr").first).to_be_attached(timeout=120_000)
    expect(page.locator("#rows")).not_to_have_text(rows_before, timeout=60_000)
    events = page.locator("#events tbody").inner_text()
    assert "died" in events and "relaunched" in events and "regrouped" in events
    loss_path = page.locator("#loss-chart path.series").get_attribute("d")
    assert loss_path.count("L") >= 5
    page.screenshot(path=str(shots / "2-after-a-worker-died.png"), full_page=True)

    assert job.finish() == 0, job.output()
    expect(page.locator("#state")).to_have_text("succeeded", timeout=30_000)
    expect(page.locator("#progress")).to_have_attribute("style", re.compile(r"width: 100%"))
    page.screenshot(path=str(shots / "3-succeeded.png"), full_page=True)
    assert not [u for u in failed_requests if "/v1/" not in u]  # nothing fetched from anywhere else
    assert len(list(shots.iterdir())) == 3
    assert refused == []  # its own script and style ran under its CSP, and nothing else was tried


def test_the_page_shows_a_warm_spare_as_a_spare_not_as_a_member(digits, start_job, browser, tmp_path):
    job = start_job("--data", digits, "--workers", "2", "--spares", "1", "--epochs", "2", "--model-def", SLOW_MODEL,
                    "--minibatch-size", "16", "--minibatches-per-task", "2")
    status = job.wait_for(lambda s: s["world_size"] == 2 and [w for w in s["workers"] if w["spare"]] and s["step"] > 2, timeout=300)
    spare = next(w for w in status["workers"] if w["spare"])
    with open(os.path.join(job.job_dir, "master.json")) as f:
        url = json.load(f)["url"]
    with open(os.path.join(job.job_dir, "view-token")) as f:
        view_token = f.read().strip()
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    page.goto(f"{url}/ui#token={view_token}")
    expect(page.locator("#state")).to_have_text("running", timeout=30_000)
    assert page.locator("#world").inner_text() == "2 / 2 + 1 spare"
    bar = page.locator(f"#timeline g.attempt[data-worker='{spare['id']}']")
    assert bar.locator("title").text_content() == f"{spare['id']} spare"
    members = [w["id"] for w in status["workers"] if w["rank"] is not None]
    member_fill = page.locator(f"#timeline g.attempt[data-worker='{members[0]}'] rect").get_attribute("fill")
    assert bar.locator("rect").get_attribute("fill") not in (member_fill, None)  # told apart at a glance
    page.screenshot(path=str(tmp_path / "spare.png"), full_page=True)
    assert job.finish() == 0, job.output()


def test_the_page_shows_no_data_without_the_right_token(browser, tmp_path):
    import socket
    import threading
    import time

    import uvicorn

    from elastic_step.master.api import create_app, server_config

    from test_master_state import make_state

    state, _ = make_state()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(server_config(create_app(state, "job-token", "view-token")))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        page = browser.new_page()
        page.goto(f"{url}/ui")
        assert "needs the job's read-only token" in page.locator("#message").inner_text()
        assert page.locator("#rows").inner_text() == "-"
        page.goto(f"{url}/ui#token=wrong")
        page.reload()
        expect(page.locator("#message")).to_contain_text("not this job", timeout=10_000)
        assert page.locator("#rows").inner_text() == "-"
        page.screenshot(path=str(tmp_path / "wrong-token.png"))
        # The view token reads; it cannot steer.
        view = {"Authorization": "Bearer view-token"}
        assert httpx.get(f"{url}/v1/status", headers=view).status_code == 200
        assert httpx.get(f"{url}/v1/events", headers=view).status_code == 200
        assert httpx.post(f"{url}/v1/stop", headers=view).status_code == 401
        assert httpx.post(f"{url}/v1/scale", headers=view, json={"workers": 2}).status_code == 401
        assert httpx.post(f"{url}/v1/heartbeat", headers=view, json={"worker_id": "w0.1"}).status_code == 401
        page_reply = httpx.get(f"{url}/ui")
        csp = page_reply.headers["content-security-policy"]
        assert page_reply.status_code == 200 and "frame-ancestors 'none'" in csp
        assert "'unsafe-inline'" not in csp and "'unsafe-eval'" not in csp
        # Only the page's own script runs (allowed by its hash): an inline script put into it is refused.
        with page.expect_console_message(lambda m: "Content Security Policy" in m.text, timeout=10_000):
            with contextlib.suppress(PlaywrightError):
                page.add_script_tag(content="document.getElementById('rows').textContent = 'injected';")
        assert page.locator("#rows").inner_text() == "-"
        own = page_reply.text.replace("http://www.w3.org/2000/svg", "")  # a namespace name, never fetched
        assert "http://" not in own and "https://" not in own and "<link" not in own and " src=" not in own
        assert state.stop_request is None and state.target == 3
    finally:
        server.should_exit = True
        thread.join(5)
        sock.close()


def test_the_pages_csp_allows_exactly_its_own_script_and_style_by_hash():
    """What a browser hashes is each inline element's text as the HTML parser reads it: every
    script and style of the served page must be allowed by a hash, and nothing by 'unsafe-inline'."""
    import base64
    import hashlib
    from html.parser import HTMLParser

    from elastic_step.master.ui_page import PAGE, PAGE_HEADERS

    class Inline(HTMLParser):
        def __init__(self):
            super().__init__()
            self.found, self.open = {"script": [], "style": []}, None

        def handle_starttag(self, tag, attrs):
            assert not [name for name, _ in attrs if name.startswith("on") or name == "style"], (tag, attrs)  # no inline handlers
            if tag in self.found:
                self.open = tag
                self.found[tag].append("")

        def handle_endtag(self, tag):
            self.open = None if tag == self.open else self.open

        def handle_data(self, data):
            if self.open:
                self.found[self.open][-1] += data

    parser = Inline()
    parser.feed(PAGE)
    policy = dict(part.strip().split(" ", 1) for part in PAGE_HEADERS["Content-Security-Policy"].split(";"))
    for tag, directive in (("script", "script-src"), ("style", "style-src")):
        hashes = {"'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'" for text in parser.found[tag]}
        assert len(parser.found[tag]) == 1 and set(policy[directive].split()) == hashes, (directive, policy[directive])
    assert "unsafe" not in PAGE_HEADERS["Content-Security-Policy"]
