"""A daemon on a background thread, for the demo, benchmarks and tests."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

from ..backends.offload import Direct
from ..config import DaemonConfig
from .parking import Parking
from .root import Daemon


class EmbeddedDaemon:
    """``with EmbeddedDaemon(config) as d: ...`` serves on ``d.socket`` until the block ends.

    Without a config it uses a fresh temporary state dir and sim dir (with
    ``overrides`` of ``DaemonConfig`` fields; simulated GPUs unless ``backend``
    says otherwise) and removes both afterwards.
    """

    def __init__(
        self,
        config: DaemonConfig | None = None,
        *,
        parking: Callable[[Direct], Parking] | None = None,
        **overrides: Any,
    ) -> None:
        self._owned: list[Path] = []
        self._parking = parking
        if config is None:
            state = Path(tempfile.mkdtemp(prefix="timesliced-"))
            config = DaemonConfig(state_dir=state, **{"backend": "sim", **overrides})
            self._owned.append(state)
            self._owned.append(config.resolved_sim_dir())
        elif overrides:
            raise ValueError("pass either a config or overrides for a fresh one")
        self.config = config
        self.daemon: Daemon | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def socket(self) -> str:
        return str(self.config.resolved_socket())

    @property
    def web_url(self) -> str | None:
        """The dashboard's address once started (``web=(host, port)`` in the config)."""
        return self.daemon.web_url if self.daemon is not None else None

    def start(self) -> EmbeddedDaemon:
        self._thread = threading.Thread(target=self._main, name="timesliced-daemon", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            self.stop()  # removes what it made
            raise self._error
        return self

    def stop(self) -> None:
        if self._loop is not None and self.daemon is not None and self._thread is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self.daemon.stop)
            self._thread.join(timeout=30)
        for path in self._owned:
            shutil.rmtree(path, ignore_errors=True)

    def __enter__(self) -> EmbeddedDaemon:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _main(self) -> None:
        async def body() -> None:
            self._loop = asyncio.get_running_loop()
            self.daemon = Daemon(self.config, self._parking)
            await self.daemon.run(ready=lambda _: self._ready.set())

        try:
            asyncio.run(body())
        except BaseException as exc:
            self._error = exc
        finally:
            self._ready.set()
