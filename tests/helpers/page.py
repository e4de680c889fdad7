"""The app's page in headless Chromium (Debian's, through Playwright): opening it, its status
line, and the figures it shows of an answer, read back to compare with the engine's own."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT

SAMPLE = ROOT / "assets" / "sample" / "python-tutorial-classes.txt"
CHROMIUM = "/usr/bin/chromium"


def open_page(playwright, url: str, timeout_ms: int):
    """Headless Chromium (Debian's) on the app at `url`, once its Send button is there: (browser, page)."""
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox"])
    pg = browser.new_page(viewport={"width": 1500, "height": 1100})
    pg.set_default_timeout(timeout_ms)
    pg.goto(url)
    pg.wait_for_selector("#tf-send")
    return browser, pg


def set_number(page, elem_id: str, value) -> None:
    """Type into a slider's number box as a person would."""
    box = page.locator(f"{elem_id} input[type=number]")
    box.click()
    box.press("Control+a")
    box.type(str(value))
    box.press("Tab")
    assert box.input_value() == str(value)


def status(page) -> str:
    """The status line's text."""
    return page.inner_text("#tf-status")


def wait_status(page, *needles: str, timeout: float = 240) -> str:
    """The status line once it shows one of `needles` (fails after `timeout` seconds)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = status(page)
        if any(n in s for n in needles):
            return s
        time.sleep(0.1)
    raise AssertionError(f"status never showed {needles}; it shows: {status(page)!r}")


def watch_status(page) -> None:
    """From now on record every text the status line shows (`window.tfStatuses`), however briefly."""
    page.evaluate("""() => {
        const el = document.querySelector('#tf-status');
        window.tfStatuses = [el.innerText];
        new MutationObserver(() => window.tfStatuses.push(el.innerText))
            .observe(el, {subtree: true, childList: true, characterData: true});
    }""")


def last_answer_tokens(page):
    """The last answer's coloured tokens (a locator): one `tf-tok` per token, in order (its
    first piece: a token across a paragraph break or into bold text goes on as `tf-tok-more`)."""
    return page.locator(".tf-assistant").last.locator(".tf-tok")


def assert_answer_text(page, content: str) -> None:
    """The last answer shows `content` as Markdown: the source its Copy Markdown button copies
    is `content`, and its text on screen (innerText) is that of `content` rendered without
    colours under the same styles, so the colours split no word and add, drop or move no
    character; no token's colour has a border, padding or margin."""
    from ui.answer_html import plain_html

    last = page.locator(".tf-assistant").last
    assert last.locator("template.tf-md").evaluate("t => t.content.textContent") == content
    shown, plain = last.locator(".tf-answer-body").evaluate("""(body, markup) => {
        const twin = document.createElement('div');
        twin.className = 'tf-answer-body';
        twin.innerHTML = markup;
        body.parentElement.appendChild(twin);
        const text = twin.innerText;
        twin.remove();
        return [body.innerText, text];
    }""", plain_html(content))
    assert shown == plain and shown.strip(), (shown, plain)
    boxes = last.locator(".tf-answer-body .tf-tok, .tf-answer-body .tf-tok-more").evaluate_all("""els => [...new Set(
        els.map(e => { const s = getComputedStyle(e);
                       return [s.paddingLeft, s.paddingRight, s.marginLeft, s.marginRight, s.borderLeftWidth,
                               s.borderRightWidth, s.display].join(' '); }))]""")
    assert boxes == ["0px 0px 0px 0px 0px 0px inline"], boxes


FOOTER = re.compile(
    r"(?P<mode>\w+) · (?P<tokens>\d+) tokens at (?P<speed>[\d.]+) tok/s"
    r"(?P<note> \(not counting (?P<waited>[\d.]+) s waiting for Step\))? · "
    r"(?:prefill (?P<prefill>[\d,]+) tokens in [\d.]+s(?:, (?P<reused>[\d,]+) reused(?: \([\d,]+ from disk\))?)? · )?"
    r"mean accepted (?P<mean>[\d.]+)(?: · acceptance (?P<acceptance>.+?))?"
    r"(?: · Stopped at the (?P<limit>\d+)-token limit\.)?")  # an answer its token limit ended (Continue)
PREFILL_ROW = re.compile(r"(?P<prefill>[\d,]+) tokens in [\d.]+s \((?P<reused>[\d,]+) reused(?:, [\d,]+ of them from disk)?\)")
GAUGE = re.compile(r"document (?P<document>[\d,]+)(?: read of its (?P<book>[\d,]+))? \+ conversation "
                   r"(?P<conversation>[\d,]+) of (?P<window>[\d,]+) tokens")
ACCEPTANCE_ROWS = {"retrieval": "acceptance, lookup / small draft → retrieval", "target": "acceptance, proposals → target"}


def number(text: str | None) -> int:
    """A figure as the page writes it ("1,234", or nothing for 0)."""
    return int((text or "0").replace(",", ""))


def shown_stats(page) -> dict[str, str]:
    """The statistics table: figure -> value."""
    return dict(page.locator("#tf-stats tr").evaluate_all(
        "rows => rows.map(r => [r.querySelector('th').innerText, r.querySelector('td').innerText])"))


def shown_gauge(page) -> re.Match:
    """The context gauge's fields (GAUGE)."""
    text = page.inner_text("#tf-gauge")
    found = GAUGE.search(text)
    assert found, text
    return found


def assert_answer_figures(page, reply: dict) -> re.Match:
    """The last answer's figures (its tokens, the statistics table, the status line and the
    answer's footer) are those of `reply`, the engine's for the same conversation; the speed
    shown is the same in each place. Returns the footer's fields."""
    usage, truth = reply["usage"], reply["triforce"]
    tokens = usage["completion_tokens"]
    per_forward = f"{truth['tokens_per_target_forward']:.2f}"
    acceptance = {level: f"{v:.2f}" for level, v in truth["acceptance"].items()}
    # the same answer: its text, shown as Markdown, and one coloured token per token
    assert last_answer_tokens(page).count() == tokens
    assert_answer_text(page, reply["choices"][0]["message"]["content"])

    rows = shown_stats(page)
    assert rows["mode"] == truth["mode"] and rows["tokens"] == str(tokens), rows
    assert rows["mean accepted length"] == f"{per_forward} tokens per target forward", rows
    assert {k: v for k, v in rows.items() if k.startswith("acceptance")} == {
        ACCEPTANCE_ROWS[level]: v for level, v in acceptance.items()}, rows
    prefill = PREFILL_ROW.fullmatch(rows["prefill"])
    assert prefill and number(prefill["prefill"]) + number(prefill["reused"]) == usage["prompt_tokens"], rows

    line = status(page).strip()
    assert page.locator(".tf-assistant").last.locator(".tf-foot").inner_text().strip() == line
    footer = FOOTER.fullmatch(line)
    assert footer, line
    assert (footer["mode"], int(footer["tokens"]), footer["mean"]) == (truth["mode"], tokens, per_forward), line
    # no acceptance where nothing was proposed (lookup found no match in the context)
    assert dict(pair.rsplit(" ", 1) for pair in (footer["acceptance"] or "").split(", ") if pair) == acceptance, line
    assert number(footer["prefill"]) + number(footer["reused"]) == usage["prompt_tokens"], line
    assert rows["tokens/s"] == footer["speed"] + (footer["note"] or ""), (rows, line)
    return footer


def document_text(path) -> str:
    """The text the app reads of a file (its loader's)."""
    from triforce_core.documents import load_document

    return load_document(Path(path)).text


def in_browser(url: str, test) -> None:
    """`test(page)` on the page at `url` in headless Chromium, on a thread of its own: Playwright's
    sync API refuses a thread where another test module's browser still runs its event loop."""
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    failed: list[BaseException] = []

    def run():
        try:
            with sync_api.sync_playwright() as p:
                browser, pg = open_page(p, url, 240_000)
                try:
                    test(pg)
                finally:
                    browser.close()
        except BaseException as e:  # noqa: BLE001 - raised again in the test's thread
            failed.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


def ask_on_page(page, path, question: str) -> str:
    """Upload `path` (words.txt), ask `question`, wait for the answer; the status line then."""
    page.set_input_files("#tf-upload input[type=file]", str(path))
    page.wait_for_selector("#tf-docinfo:has-text('words.txt')")
    page.fill("#tf-message textarea", question)
    page.click("#tf-send")
    done = wait_status(page, "tok/s", "rror")
    assert "triforce" in done and "tok/s" in done, done
    return done
