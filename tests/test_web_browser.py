"""The chat page at `/` in a real headless Chromium (Debian's `chromium`, driven by Playwright):
a 3-turn chat against a real `turnkv serve` with an API key. The page asks for the key, replies
stream in (the reply's text changes several times before its stats appear), turns 2 and 3 show
cached tokens > 0, and each reply's stats name the speculative mode and its tokens a decode step.
A screenshot is saved in the test's tmp dir.

Skips when no Chromium is installed (`.ci/run` installs Debian's package when it can).
"""

from __future__ import annotations

import re
import shutil

import pytest

from test_server import Server, require_model

MODEL = "smollm2-135m"
KEY = "browser-key"
QUESTIONS = ["What can we sow this weekend?", "How far apart should the beans go?", "And the tomatoes?"]


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def server():
    require_model(MODEL)
    if chromium_path() is None:
        pytest.skip("no Chromium on PATH (apt-get install chromium)")
    pytest.importorskip("playwright.sync_api")
    srv = Server.start(MODEL, api_key=KEY)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def test_three_turn_chat_in_a_real_browser(server, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path(), headless=True,
                                    args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.goto(server.url + "/")
            page.wait_for_selector("#key-dialog[open]", timeout=30_000)      # the server has a key
            page.fill("#key-input", KEY)
            page.press("#key-input", "Enter")
            page.wait_for_function("document.querySelector('#model').options.length > 0", timeout=30_000)
            page.fill("#max-tokens", "48")
            cached, updates = [], 0
            for turn, question in enumerate(QUESTIONS, 1):
                page.evaluate("""() => {
                    window.__updates = 0;
                    const last = () => [...document.querySelectorAll('#messages .msg.assistant .body')].pop();
                    window.__obs && window.__obs.disconnect();
                    window.__obs = new MutationObserver(() => {
                        const b = last();
                        if (b && !b.parentElement.querySelector('.stats')) window.__updates++;
                    });
                    window.__obs.observe(document.querySelector('#messages'),
                                         {subtree: true, childList: true, characterData: true});
                }""")
                page.fill("#input", question)
                page.click("#send")
                page.wait_for_function(f"document.querySelectorAll('#messages .msg.assistant .stats').length >= {turn}",
                                       timeout=300_000)
                reply = page.locator("#messages .msg.assistant .body").nth(turn - 1).inner_text()
                assert reply.strip(), f"turn {turn}: empty reply"
                # streamed: the reply's text changed several times before its stats were shown (the
                # page renders each network read: a short reply read in one or two bursts on a busy
                # machine changes fewer times, so all turns' changes are counted together)
                updates += page.evaluate("window.__updates")
                stats = page.locator("#messages .msg.assistant .stats").nth(turn - 1).inner_text()
                found = re.search(r"cached (\d+) tok", stats)
                assert found, stats
                cached.append(int(found.group(1)))
                # serve's default speculative mode and the reply's tokens a decode step (>= 1: drafts taken)
                spec = re.search(r"speculative (auto|off \(auto_check_pending\)) (\d+\.\d+) tok/step", stats)
                assert spec and float(spec.group(2)) >= 1.0, stats
            assert updates >= 3 * len(QUESTIONS), f"the replies did not stream: {updates} changes"
            assert cached[1] > 0 and cached[2] > cached[1], cached
            page.wait_for_selector("#cache-stats dt", timeout=30_000)           # the cache panel filled in
            page.screenshot(path=str(tmp_path / "chat.png"), full_page=True)
            assert (tmp_path / "chat.png").stat().st_size > 10_000
            assert not errors, errors
        finally:
            browser.close()
