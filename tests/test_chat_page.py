"""The web chat page at `/`, driven in a real headless Chromium over the DevTools protocol: an
answer streams in, the Stop button ends a generation, Markdown is rendered and never injects HTML.

Needs a Chromium on PATH (Debian: `apt-get install chromium`; or $CANDELABRA_CHROMIUM) and the
`websockets` package; with CANDELABRA_SCREENSHOT=FILE it saves a screenshot of a streamed answer."""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import subprocess
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from live_server import LiveServer, write_chat_checkpoint

BROWSERS = ("chromium", "chromium-browser", "chromium-headless-shell", "google-chrome", "google-chrome-stable")

pytestmark = pytest.mark.slow


def find_chromium() -> str | None:
    named = os.environ.get("CANDELABRA_CHROMIUM")
    if named:
        return named
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


class Browser:
    """A headless Chromium with one page, spoken to over the Chrome DevTools protocol."""

    def __init__(self, executable: str, profile: Path) -> None:
        from websockets.sync.client import connect

        self.process = subprocess.Popen(
            [executable, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
             "--no-default-browser-check", "--remote-debugging-port=0", "--remote-allow-origins=*",
             f"--user-data-dir={profile}", "--window-size=1280,820", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.close()
                raise RuntimeError(f"{executable} did not open its DevTools port")
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        targets = httpx.get(f"http://127.0.0.1:{port}/json/list").json()
        page = next(t for t in targets if t["type"] == "page")
        self.connection = ExitStack()
        self.socket = self.connection.enter_context(connect(page["webSocketDebuggerUrl"], max_size=None,
                                                            open_timeout=30))
        self.ids = itertools.count(1)
        self.call("Page.enable")
        self.call("Runtime.enable")

    def call(self, method: str, **params) -> dict:
        ident = next(self.ids)
        self.socket.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self.socket.recv(timeout=60))
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression!r} failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {expression}")

    def open(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete' && document.querySelectorAll('#model option').length > 0")

    def type_into(self, selector: str, text: str) -> None:
        self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        self.call("Input.insertText", text=text)

    def click(self, selector: str) -> None:
        box = self.evaluate(f"(() => {{ const r = document.querySelector({json.dumps(selector)})"
                            ".getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    def set_value(self, selector: str, value: str) -> None:
        self.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.value = "
                      f"{json.dumps(value)}; e.dispatchEvent(new Event('change')); }})()")

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        if getattr(self, "connection", None) is not None:
            self.connection.close()
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()


ANSWER = "document.querySelector('#messages .message.assistant:last-child')"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = write_chat_checkpoint(tmp_path_factory.mktemp("chat-page-model"))
    with LiveServer("--weight-path", str(folder), "--backend", "cpu", "--kvcache-mem-gpu", "4",
                    "--kvcache-mem-cpu", "1", "--served-model-name", "tiny-chat") as live:
        yield live


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    pytest.importorskip("websockets", reason="the chat page test speaks to Chromium through `websockets`")
    executable = find_chromium()
    if executable is None:
        pytest.skip("no Chromium found (apt-get install chromium, or set CANDELABRA_CHROMIUM to a Chrome binary)")
    browser = Browser(executable, tmp_path_factory.mktemp("chromium-profile"))
    yield browser
    browser.close()


@pytest.fixture
def page(server, browser):
    browser.open(server.url + "/")
    browser.evaluate("localStorage.clear()")
    browser.open(server.url + "/")
    return browser


def answer_text(browser: Browser) -> str:
    return browser.evaluate(f"{ANSWER}?.querySelector('.content').textContent ?? ''")


def finished(server: LiveServer, reason: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith("candelabra_requests_finished_total") and f'finish_reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_start_up_lines_name_the_chat_page(server):
    deadline = time.monotonic() + 10
    while f"chat page {server.url}/" not in "".join(server.output) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"chat page {server.url}/" in "".join(server.output)


def test_an_answer_streams_in(server, page):
    assert page.evaluate("document.querySelector('#model').value") == "tiny-chat"
    page.set_value("#temperature", "0")
    page.set_value("#max-tokens", "60")
    page.type_into("#prompt", "w10 w11 w12")
    page.click("#send")

    page.wait_for(f"{ANSWER}?.querySelector('.content').textContent.length > 0")
    first_seen = answer_text(page)
    page.wait_for(f"{ANSWER}.dataset.state !== 'streaming'", timeout=60)
    assert page.evaluate(f"{ANSWER}.dataset.state") == "done"
    text = answer_text(page)
    assert text.startswith(first_seen.rstrip("▍"))
    assert text.startswith("w"), text
    assert page.evaluate("document.querySelector('#messages .message.user').textContent").endswith("w10 w11 w12")
    assert page.evaluate("!document.querySelector('#send').hidden && document.querySelector('#stop').hidden")
    assert page.evaluate("document.querySelectorAll('#history .conversation').length") == 1
    screenshot = os.environ.get("CANDELABRA_SCREENSHOT")
    if screenshot:
        page.screenshot(Path(screenshot))


def test_the_stop_button_ends_a_long_generation(server, page):
    aborted = finished(server, "abort")
    page.set_value("#max-tokens", "450")
    # The random model may end at once; a long generation needs it to ignore its end token.
    page.evaluate("""(() => { const original = window.fetch; window.fetch = (url, options) => {
        if (options?.body) options = { ...options, body: JSON.stringify({ ...JSON.parse(options.body),
                                                                         ignore_eos: true }) };
        return original(url, options); }; })()""")
    page.type_into("#prompt", "w20 w21")
    page.click("#send")
    page.wait_for(f"{ANSWER}?.querySelector('.content').textContent.length > 0")
    assert page.evaluate("!document.querySelector('#stop').hidden")
    page.click("#stop")

    page.wait_for(f"{ANSWER}.dataset.state === 'stopped'")
    assert page.evaluate(f"{ANSWER}.querySelector('.note').textContent") == "Stopped."
    assert page.evaluate("!document.querySelector('#send').hidden")
    stopped_at = answer_text(page)
    assert len(stopped_at.split()) < 450
    deadline = time.monotonic() + 20
    while finished(server, "abort") < aborted + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert finished(server, "abort") == aborted + 1
    time.sleep(0.3)
    assert answer_text(page) == stopped_at


def test_thinking_is_shown_apart_from_the_answer(page):
    page.set_value("#thinking", "on")
    page.set_value("#temperature", "0")
    page.set_value("#max-tokens", "12")
    page.type_into("#prompt", "w10 w11 w12")
    page.click("#send")
    page.wait_for(f"{ANSWER}.dataset.state === 'done'", timeout=60)
    thinking = page.evaluate(f"{ANSWER}.querySelector('.thinking-body').textContent")
    assert thinking.strip(), "the template opens <think>, so the answer starts with thinking"
    assert page.evaluate(f"!{ANSWER}.querySelector('.thinking').hidden")
    assert thinking not in answer_text(page)


def test_new_chat_keeps_the_old_one_in_the_history(page):
    page.set_value("#max-tokens", "4")
    page.type_into("#prompt", "w40")
    page.click("#send")
    page.wait_for(f"{ANSWER}.dataset.state === 'done'", timeout=60)
    page.click("#new-chat")
    assert page.evaluate("document.querySelectorAll('#messages .message').length") == 0
    page.type_into("#prompt", "w41")
    page.click("#send")
    page.wait_for(f"{ANSWER}.dataset.state === 'done'", timeout=60)
    titles = page.evaluate("[...document.querySelectorAll('#history .conversation')].map(b => b.textContent)")
    assert titles == ["w41", "w40"]
    page.click("#history .conversation:last-child")
    assert page.evaluate("document.querySelector('#messages .message.user').textContent").endswith("w40")


def test_markdown_is_rendered_and_html_in_it_is_shown_as_text(page):
    source = ("# Title\n\nSome **bold**, *italic* and `x < y` text.\n\n- one\n- two\n\n1. first\n2. second\n\n"
              "```python\nprint('<b>hi</b>')\n```\n\n[docs](https://example.com) [bad](javascript:alert(1))\n\n"
              "<script>window.injected = true</script><img src=x onerror=\"window.injected = true\">")
    html = page.evaluate(f"import('/static/markdown.js').then(m => m.renderMarkdown({json.dumps(source)}))")
    checks = page.evaluate(f"""(() => {{
        const box = document.createElement('div');
        box.innerHTML = {json.dumps(html)};
        document.body.append(box);
        const result = {{
            h1: box.querySelector('h1')?.textContent,
            strong: box.querySelector('strong')?.textContent,
            em: box.querySelector('em')?.textContent,
            code: box.querySelector('p code')?.textContent,
            items: [...box.querySelectorAll('ul li')].map(li => li.textContent),
            ordered: [...box.querySelectorAll('ol li')].map(li => li.textContent),
            lang: box.querySelector('.code-lang')?.textContent,
            block: box.querySelector('pre code')?.textContent,
            links: [...box.querySelectorAll('a')].map(a => a.getAttribute('href')),
            scripts: box.querySelectorAll('script, img').length,
            text: box.textContent,
        }};
        box.remove();
        return result;
    }})()""")
    assert checks["h1"] == "Title"
    assert (checks["strong"], checks["em"], checks["code"]) == ("bold", "italic", "x < y")
    assert checks["items"] == ["one", "two"] and checks["ordered"] == ["first", "second"]
    assert checks["lang"] == "python" and checks["block"] == "print('<b>hi</b>')"
    assert checks["links"] == ["https://example.com"]
    assert checks["scripts"] == 0
    assert "<script>window.injected = true</script>" in checks["text"]
    assert page.evaluate("window.injected === undefined")


def test_without_the_page_the_root_is_not_found(tmp_path):
    from fastapi.testclient import TestClient

    from candelabra.core.server.app import build_app
    from candelabra.core.server.chat_page import STATIC

    assert {"index.html", "chat.js", "chat.css", "markdown.js"} <= {p.name for p in STATIC.iterdir()}
    for name in ("index.html", "chat.js", "chat.css"):
        text = (STATIC / name).read_text()
        assert "http://" not in text and "https://" not in text, f"{name} must load nothing from the internet"
    with TestClient(build_app(served=None, chat_page=False)) as client:
        assert client.get("/").status_code == 404
    with TestClient(build_app(served=None, chat_page=True)) as client:
        assert "text/html" in client.get("/").headers["content-type"]
        assert "javascript" in client.get("/static/chat.js").headers["content-type"]


def test_no_ui_turns_the_page_off_and_ui_server_is_accepted():
    import argparse

    from candelabra.core.server.launch import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).no_ui is False
    assert parser.parse_args(["--no-ui"]).no_ui is True
    assert parser.parse_args(["--ui-server"]).no_ui is False


def test_the_api_key_field_sends_the_key_as_bearer(browser, tmp_path):
    folder = write_chat_checkpoint(tmp_path)
    with LiveServer("--weight-path", str(folder), "--backend", "cpu", "--kvcache-mem-gpu", "4", "--kvcache-mem-cpu",
                    "1", env={"CANDELABRA_API_KEY": "sesame"}) as server:
        browser.call("Page.navigate", url=server.url + "/")
        browser.wait_for("document.querySelector('#server-status')?.textContent.includes('API key')")
        browser.set_value("#api-key", "sesame")
        browser.wait_for("document.querySelectorAll('#model option').length > 0")
        browser.set_value("#max-tokens", "4")
        browser.type_into("#prompt", "w50")
        browser.click("#send")
        assert browser.wait_for(f"{ANSWER}.dataset.state !== 'streaming' && {ANSWER}.dataset.state", 60) == "done"
        browser.evaluate("localStorage.clear()")
