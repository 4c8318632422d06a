"""Fake vLLM and SGLang servers: real HTTP servers that imitate the engines' sleep APIs.

Each fake keeps the state the real engine keeps (asleep or not, at which
level, which parts are released), answers as the real routes do, and models
the device memory each part holds, so a test can check what a backend left
behind. Failures are injected per call: an error answer, a slow answer, a
dropped connection. The engine handles one control call at a time, as the
real engines do (their engine core or scheduler serialises them), so a call
that arrives while a slow one is in progress waits for it.

In a test::

    fake = FakeVllm()
    url = await fake.start()
    ...
    await fake.stop()

As a process (for tests that run a daemon)::

    python -m tests.fakes.engines vllm --port 0

prints its base URL on one line and serves until killed. ``GET /_fake/state``
returns its state and call log as JSON and ``POST /_fake/inject`` takes the
arguments of :meth:`FakeEngine.inject` as a JSON object.

Where the real engine's answer to a mistake is worse than an error (SGLang's
scheduler fails on a resume of something not released), the fake answers 400
instead, so tests see the mistake.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from aiohttp import web

GiB = 1 << 30
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Call:
    """One request as the fake saw it; ``status`` is what it answered (None: dropped the connection)."""

    method: str
    path: str
    query: tuple[tuple[str, str], ...]
    body: Any
    status: int | None


@dataclass
class Fault:
    """What to do instead of (or before) answering the next ``times`` matching calls."""

    times: int = 1
    path: str | None = None  # only calls to this path; None: any engine route
    status: int | None = None  # answer this status and body instead of handling the call
    body: str = "injected failure"
    delay: float = 0.0  # seconds to wait (holding the engine) before anything else
    drop: bool = False  # close the connection without answering
    apply: bool | None = None  # carry out the call anyway; default: only when answering normally


@dataclass
class _Recorded:
    calls: list[Call] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)


class FakeEngine:
    """The common machinery: the HTTP server, fault injection and the call log."""

    engine = ""
    routes: tuple[tuple[str, str], ...] = ()  # (method, path) of the engine's control routes

    def __init__(self, *, sizes: dict[str, int], host: str = "127.0.0.1", port: int = 0) -> None:
        self.sizes = dict(sizes)  # part -> device bytes it holds when resident
        self.host = host
        self.port = port
        self.url = ""
        self._log = _Recorded()
        self._engine_lock = asyncio.Lock()
        self._stopping = asyncio.Event()
        self._gate = asyncio.Event()
        self._gate.set()
        self.held = 0  # calls waiting at the gate (see hold)
        self._runner: web.AppRunner | None = None

    # --- life --------------------------------------------------------------------------

    async def start(self) -> str:
        """Bind and serve; returns the base URL (with the real port when ``port`` was 0)."""
        app = web.Application()
        for method, path in self.routes:
            app.router.add_route(method, path, self._wrap(path, getattr(self, "_" + path.strip("/"))))
        app.router.add_get("/_fake/state", self._get_state)
        app.router.add_post("/_fake/inject", self._post_inject)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.port = port
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        """Stop serving; calls held by a delay end at once."""
        self._stopping.set()
        self._gate.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --- test controls -----------------------------------------------------------------

    def inject(
        self,
        times: int = 1,
        *,
        path: str | None = None,
        status: int | None = None,
        body: str = "injected failure",
        delay: float = 0.0,
        drop: bool = False,
        apply: bool | None = None,
    ) -> None:
        """Make the next ``times`` calls (to ``path``, if given) fail or stall; see :class:`Fault`."""
        if path is not None and path not in {p for _, p in self.routes}:
            raise ValueError(f"{self.engine} has no route {path!r}")
        self._log.faults.append(Fault(times, path, status, body, delay, drop, apply))

    def hold(self) -> None:
        """Make calls wait (before anything else) until :meth:`release`; ``held`` counts them."""
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    @property
    def calls(self) -> list[Call]:
        return list(self._log.calls)

    def paths(self) -> list[str]:
        """The paths called, in order, with their query strings: a compact call log."""
        out = []
        for c in self._log.calls:
            query = "&".join(f"{k}={v}" for k, v in c.query)
            out.append(c.path + (f"?{query}" if query else ""))
        return out

    def resident_bytes(self) -> int:
        """Device bytes the engine holds now."""
        return sum(n for part, n in self.sizes.items() if part not in self.released())

    def released(self) -> frozenset[str]:
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        return {"engine": self.engine, "released": sorted(self.released()), "resident_bytes": self.resident_bytes()}

    # --- serving -----------------------------------------------------------------------

    def _wrap(self, path: str, handle: Handler) -> Handler:
        async def handler(request: web.Request) -> web.StreamResponse:
            raw = await request.read()
            try:
                body: Any = json.loads(raw) if raw else None
            except ValueError:
                body = raw.decode("utf-8", "replace")
            query = tuple(request.query.items())
            if not self._gate.is_set():
                self.held += 1
                try:
                    await self._gate.wait()
                finally:
                    self.held -= 1
            fault = self._take_fault(path)
            async with self._engine_lock:
                if fault is not None and fault.delay:
                    try:
                        await asyncio.wait_for(self._stopping.wait(), fault.delay)
                    except asyncio.TimeoutError:
                        pass
                answering = fault is None or (fault.status is None and not fault.drop)
                apply = answering if fault is None or fault.apply is None else fault.apply
                response = await handle(request) if apply else None
                if fault is not None and fault.drop:
                    self._log.calls.append(Call(request.method, path, query, body, None))
                    assert request.transport is not None
                    request.transport.abort()
                    return web.Response()  # never sent: the connection is gone
                if fault is not None and fault.status is not None:
                    response = web.Response(status=fault.status, text=fault.body)
                assert response is not None
                self._log.calls.append(Call(request.method, path, query, body, response.status))
                return response

        return handler

    def _take_fault(self, path: str) -> Fault | None:
        for fault in self._log.faults:
            if fault.times > 0 and fault.path in (None, path):
                fault.times -= 1
                return fault
        return None

    async def _get_state(self, request: web.Request) -> web.Response:
        return web.json_response({**self.state(), "calls": [asdict(c) for c in self._log.calls]})

    async def _post_inject(self, request: web.Request) -> web.Response:
        try:
            self.inject(**await request.json())
        except (TypeError, ValueError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response({"ok": True})


class FakeVllm(FakeEngine):
    """A vLLM OpenAI server's sleep-mode routes.

    ``dev_mode=False``: started without ``VLLM_SERVER_DEV_MODE=1``; the
    routes do not exist (404, FastAPI's body). ``sleep_mode=False``: started
    without ``--enable-sleep-mode``; sleeping fails inside the engine (500).
    """

    engine = "vllm"
    routes = (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"))

    def __init__(
        self,
        *,
        dev_mode: bool = True,
        sleep_mode: bool = True,
        weights: int = 4 * GiB,
        kv_cache: int = 8 * GiB,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        super().__init__(sizes={"weights": weights, "kv_cache": kv_cache}, host=host, port=port)
        self.dev_mode = dev_mode
        self.sleep_mode = sleep_mode
        self.level: int | None = None  # the level of the current sleep
        self.sleeping_tags: set[str] = set()  # the parts still asleep
        self.weights_lost = False  # a level-2 sleep discarded the weights

    @property
    def sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    def released(self) -> frozenset[str]:
        return frozenset(self.sleeping_tags)

    def state(self) -> dict[str, Any]:
        return {**super().state(), "sleeping": self.sleeping, "level": self.level, "weights_lost": self.weights_lost}

    async def _sleep(self, request: web.Request) -> web.Response:
        if not self.dev_mode:
            return _not_found()
        raw = request.query.get("level", "1")
        try:
            level = int(raw)
        except ValueError:
            # The real route calls int() on it unguarded.
            return web.Response(status=500, text="Internal Server Error")
        if level not in (1, 2):
            # Stricter than vLLM, which sleeps like level 2 at any level but 1.
            return _openai_error(400, f"invalid sleep level {raw!r}; expected 1 or 2")
        if not self.sleep_mode:
            return web.Response(status=500, text="Internal Server Error")
        if self.sleeping:
            return web.Response()  # "Executor is already sleeping": a no-op
        self.level = level
        self.sleeping_tags = {"weights", "kv_cache"}
        self.weights_lost = level == 2
        return web.Response()

    async def _wake_up(self, request: web.Request) -> web.Response:
        if not self.dev_mode:
            return _not_found()
        tags = request.query.getall("tags", [])
        if not self.sleeping:
            return web.Response()  # "Executor is not sleeping": a no-op
        if any(t not in self.sleeping_tags for t in tags):
            return web.Response()  # "Tag ... is not in sleeping tags": ignored, still asleep
        self.sleeping_tags -= set(tags) if tags else self.sleeping_tags
        if not self.sleeping_tags:
            self.level = None
        return web.Response()

    async def _is_sleeping(self, request: web.Request) -> web.Response:
        if not self.dev_mode:
            return _not_found()
        return web.json_response({"is_sleeping": self.sleeping})


class FakeSglang(FakeEngine):
    """An SGLang server's memory occupation routes (started with ``--enable-memory-saver``)."""

    engine = "sglang"
    all_tags = ("kv_cache", "weights", "cuda_graph")
    routes = (
        ("POST", "/release_memory_occupation"),
        ("GET", "/release_memory_occupation"),
        ("POST", "/resume_memory_occupation"),
        ("GET", "/resume_memory_occupation"),
    )

    def __init__(
        self,
        *,
        weights: int = 4 * GiB,
        kv_cache: int = 8 * GiB,
        cuda_graph: int = 1 * GiB,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        super().__init__(
            sizes={"weights": weights, "kv_cache": kv_cache, "cuda_graph": cuda_graph}, host=host, port=port
        )
        self.released_tags: set[str] = set()

    def released(self) -> frozenset[str]:
        return frozenset(self.released_tags)

    async def _release_memory_occupation(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)
        if isinstance(tags, web.Response):
            return tags
        twice = sorted(set(tags) & self.released_tags)
        if twice:
            return _sglang_error(f"memory of {twice} is already released")
        self.released_tags |= set(tags)  # an unknown tag is recorded and frees nothing, as in SGLang
        return web.json_response(None)

    async def _resume_memory_occupation(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)
        if isinstance(tags, web.Response):
            return tags
        missing = sorted(set(tags) - self.released_tags)
        if missing:
            return _sglang_error(f"memory of {missing} is not released")
        self.released_tags -= set(tags)
        return web.json_response(None)

    async def _tags(self, request: web.Request) -> list[str] | web.Response:
        """The request's tags (all parts when it names none), or the 400 SGLang answers a bad body with."""
        raw = await request.read()
        try:
            body = json.loads(raw)
        except ValueError:
            return _validation_error("body: a JSON object is required")
        if not isinstance(body, dict):
            return _validation_error("body: Input should be a valid dictionary")
        tags = body.get("tags")
        if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
            return _validation_error("tags: Input should be a valid list of strings")
        return list(tags) if tags else list(self.all_tags)


def _not_found() -> web.Response:
    return web.json_response({"detail": "Not Found"}, status=404)


def _openai_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "BadRequestError", "code": status}}, status=status)


def _sglang_error(message: str) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=400)


def _validation_error(message: str) -> web.Response:
    error = {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}
    return web.json_response(error, status=400)


FAKES: dict[str, type[FakeEngine]] = {"vllm": FakeVllm, "sglang": FakeSglang}


async def _serve(args: argparse.Namespace) -> None:
    fake: FakeEngine
    if args.engine == "vllm":
        fake = FakeVllm(
            dev_mode=not args.no_dev_mode, sleep_mode=not args.no_sleep_mode, host=args.host, port=args.port
        )
    else:
        fake = FakeSglang(host=args.host, port=args.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(await fake.start(), flush=True)
    try:
        await stop.wait()
    finally:
        await fake.stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tests.fakes.engines", description="Serve a fake vLLM or SGLang engine."
    )
    parser.add_argument("engine", choices=sorted(FAKES))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--no-dev-mode", action="store_true", help="vllm: as if VLLM_SERVER_DEV_MODE were unset")
    parser.add_argument("--no-sleep-mode", action="store_true", help="vllm: as if --enable-sleep-mode were not given")
    asyncio.run(_serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main(sys.argv[1:])
