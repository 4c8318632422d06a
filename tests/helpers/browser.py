"""What browser tests share: screenshots, a page's console, waiting for live updates, a served app."""

from __future__ import annotations

import asyncio
import os
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiohttp import web
    from playwright.sync_api import ConsoleMessage, Page

REPO = Path(__file__).resolve().parents[2]


def artifacts_dir() -> Path:
    """Where screenshots go: ``$TIMESLICED_ARTIFACTS``, else ``<repo>/test-artifacts/`` (created)."""
    path = Path(os.environ.get("TIMESLICED_ARTIFACTS") or REPO / "test-artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def screenshot(page: Page, name: str, *, full_page: bool = True) -> Path:
    """Save a PNG of ``page`` as ``NAME.png`` in the artifacts folder and return its path."""
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise ValueError(f"screenshot names are plain file names, not {name!r}")
    path = artifacts_dir() / f"{name}.png"
    page.screenshot(path=str(path), full_page=full_page)
    return path


class Console:
    """Console errors and page errors of one page; ``allow(pattern)`` excuses the expected ones."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self._allowed: list[re.Pattern[str]] = []

    def allow(self, pattern: str) -> None:
        self._allowed.append(re.compile(pattern))

    def on_console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            location = message.location or {}
            self.errors.append(
                f"console: {message.text} ({location.get('url', '?')}:{location.get('lineNumber', '?')})"
            )

    def on_page_error(self, error: Any) -> None:
        self.errors.append(f"page error: {error}")

    def unexpected(self) -> list[str]:
        return [e for e in self.errors if not any(p.search(e) for p in self._allowed)]


def wait_live(page: Page) -> None:
    """Until the dashboard page has applied at least one status update from its stream."""
    from playwright.sync_api import expect

    expect(page.locator("body")).to_have_attribute("data-updates", re.compile(r"^[1-9][0-9]*$"))
    expect(page.locator("#live")).to_have_attribute("data-state", "live")


class ServedApp:
    """An aiohttp application served on 127.0.0.1 (a free port) by a background thread.

    ``with ServedApp(lambda: make_app(...)) as served: served.url`` ; ``stop()`` may come early
    (to see what the page does when the server goes away) and is idempotent.
    """

    def __init__(self, factory: Callable[[], web.Application]) -> None:
        self._factory = factory
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="dashboard-server", daemon=True)
        self.url = ""

    def start(self) -> ServedApp:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the dashboard did not start in time")
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(15)
            assert not self._thread.is_alive(), "the dashboard did not stop in time"

    def __enter__(self) -> ServedApp:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _main(self) -> None:
        from timesliced.dashboard import serve

        async def body() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            try:
                runner, (host, port) = await serve(self._factory(), "127.0.0.1", 0)
            except BaseException as exc:
                self._error = exc
                self._ready.set()
                return
            self.url = f"http://{host}:{port}"
            self._ready.set()
            try:
                await self._stop.wait()
            finally:
                await runner.cleanup()

        asyncio.run(body())
