"""Browser fixtures: real headless Chromium driven by Python playwright.

Reusable by any browser test (a fake source here, a real daemon elsewhere):

- ``browser`` (module scope): a launched Chromium. Without Chromium or playwright the tests
  skip, or fail when ``TIMESLICED_REQUIRE_BROWSER=1`` (CI sets it).
- ``console`` / ``browser_page``: a fresh page whose console errors and uncaught page errors are
  recorded; the test fails at teardown if there were any that it did not ``console.allow(...)``.
- ``screenshot``: a fixture for ``tests.helpers.browser.screenshot(page, name)``, which saves
  ``NAME.png`` under ``$TIMESLICED_ARTIFACTS`` (default ``<repo>/test-artifacts/``).

``tests/helpers/browser.py`` also has ``wait_live(page)`` (until a dashboard page has applied a
status update from its live stream; the pages' Content-Security-Policy forbids eval, so wait with
``expect(...)`` on the DOM rather than ``page.wait_for_function``) and ``ServedApp`` (an aiohttp
application on 127.0.0.1:0 on a background thread, for tests that drive the dashboard with a fake
source).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ..helpers.browser import Console, screenshot

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

CHROMIUM = os.environ.get("TIMESLICED_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
VIEWPORT = {"width": 1360, "height": 900}


def _browser_problem() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "the Python package playwright is not installed"
    if not Path(CHROMIUM).is_file():
        return f"no Chromium at {CHROMIUM} (install the distribution's chromium package, or set TIMESLICED_CHROMIUM)"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Headless Chromium for one test module (module scope: playwright's loop must not outlive the module)."""
    problem = _browser_problem()
    if problem is not None:
        if os.environ.get("TIMESLICED_REQUIRE_BROWSER") == "1":
            pytest.fail(f"TIMESLICED_REQUIRE_BROWSER=1 but the browser tests cannot run: {problem}", pytrace=False)
        pytest.skip(problem)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        launched = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture
def console() -> Console:
    return Console()


@pytest.fixture
def browser_page(browser: Browser, console: Console) -> Iterator[Page]:
    """A new page in its own context; fails the test at teardown on any unexpected console or page error."""
    context = browser.new_context(viewport=VIEWPORT)  # type: ignore[arg-type]
    page = context.new_page()
    page.set_default_timeout(10_000)
    page.on("console", console.on_console)
    page.on("pageerror", console.on_page_error)
    try:
        yield page
    finally:
        context.close()
    unexpected = console.unexpected()
    assert not unexpected, "the page logged errors:\n" + "\n".join(unexpected)


@pytest.fixture(name="screenshot")
def screenshot_fixture() -> Callable[..., Path]:
    return screenshot
