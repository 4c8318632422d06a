"""Fake vLLM and SGLang servers: real HTTP servers that imitate the engines' sleep APIs.

Each fake keeps the state the real engine keeps (asleep or not, at which
level, which parts are released, whether generation is paused, the requests
in flight), answers as the real routes do, and models the device memory each
part holds, so a test can check what a backend left behind. Failures are
injected per call: an error answer, a slow answer, a dropped connection, or a
success answer that does nothing (``status=200``). The engine handles one
control call at a time, as the real engines do (their engine core or
scheduler serialises them), so a call that arrives while a slow one is in
progress waits for it.

In a test::

    fake = FakeVllm()
    url = await fake.start()
    ...
    await fake.stop()

As a process (for tests that run a daemon)::

    python -m tests.fakes.engines vllm --port 0

prints its base URL on one line and serves until killed. ``GET /_fake/state``
returns its state and call log as JSON, ``POST /_fake/inject`` takes the
arguments of :meth:`FakeEngine.inject` as a JSON object, and
``POST /_fake/requests`` takes ``{"running": n}``: n requests in flight.

Where the real engine's answer to a mistake is worse than an error (SGLang's
scheduler fails on a resume of something not released), the fake answers 400
instead, so tests see the mistake. Where the real engine dies (SGLang's
scheduler asserts that nothing is in flight when it releases memory), the
fake dies too: it drops every connection from then on and says so in
``crashed``.
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


class _Crash(Exception):
    """The engine's scheduler died: the server goes down with it."""


class FakeEngine:
    """The common machinery: the HTTP server, fault injection, requests in flight and the call log."""

    engine = ""
    routes: tuple[tuple[str, str], ...] = ()  # (method, path) of the engine's control routes

    def __init__(self, *, sizes: dict[str, int], host: str = "127.0.0.1", port: int = 0) -> None:
        self.sizes = dict(sizes)  # part -> device bytes it holds when resident
        self.host = host
        self.port = port
        self.url = ""
        self.crashed = ""  # why the server died; "" while it lives
        self.aborted = 0  # requests the engine aborted (their callers got partial output)
        self._log = _Recorded()
        self._engine_lock = asyncio.Lock()
        self._stopping = asyncio.Event()
        self._gate = asyncio.Event()
        self._gate.set()
        self._requests_changed = asyncio.Event()
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
        app.router.add_post("/_fake/requests", self._post_requests)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        host, port = self._runner.addresses[0][:2]
        self.port = port
        self.url = f"http://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        """Stop serving; calls held by a delay or waiting for requests end at once."""
        self._stopping.set()
        self._gate.set()
        self._requests_changed.set()
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

    def run_requests(self, n: int) -> None:
        """Set the number of generation requests running now (they finish when it is set lower)."""
        if n < 0:
            raise ValueError(f"cannot run {n} requests")
        self._set_running(n)
        self._requests_changed.set()

    def _set_running(self, n: int) -> None:
        raise NotImplementedError

    async def _until_requests_change(self) -> None:
        self._requests_changed.clear()
        await self._requests_changed.wait()

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
        """The parts whose device memory is freed now."""
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "released": sorted(self.released()),
            "resident_bytes": self.resident_bytes(),
            "crashed": self.crashed,
            "aborted": self.aborted,
        }

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
                response: web.StreamResponse | None = None
                crash = bool(self.crashed)
                if apply and not crash:
                    try:
                        response = await handle(request)
                    except _Crash as exc:
                        self.crashed = str(exc)
                        crash = True
                if crash or (fault is not None and fault.drop):
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

    async def _post_requests(self, request: web.Request) -> web.Response:
        try:
            self.run_requests(int((await request.json())["running"]))
        except (TypeError, ValueError, KeyError) as exc:
            return web.json_response({"error": str(exc)}, status=400)
        return web.json_response({"ok": True})


class FakeVllm(FakeEngine):
    """A vLLM OpenAI server's sleep-mode routes (``vllm/entrypoints/serve/sleep/api_router.py``).

    ``dev_mode=False``: started without ``VLLM_SERVER_DEV_MODE=1``; the
    routes do not exist (404, FastAPI's body). ``sleep_mode=False``: started
    without ``--enable-sleep-mode``; sleeping fails inside the engine (500).
    ``pause_modes=False``: a vLLM before 0.17, whose ``/sleep`` reads only
    ``level``: it sleeps at once whatever runs (``slept_with_requests``
    counts the requests it cut off; vLLM leaves them undefined). With pause
    modes, ``mode`` (default ``abort``) says what a sleep does with the
    requests in flight: ``abort`` aborts them, ``wait`` lets them finish
    first (the sleep's answer waits), ``keep`` freezes them (the sleep then
    discards the KV cache they need: counted in ``slept_with_requests``).
    """

    engine = "vllm"
    routes = (("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/is_sleeping"), ("POST", "/collective_rpc"))
    modes = ("abort", "wait", "keep")  # vllm.v1.engine.PauseMode

    def __init__(
        self,
        *,
        dev_mode: bool = True,
        sleep_mode: bool = True,
        pause_modes: bool = True,
        weights: int = 4 * GiB,
        kv_cache: int = 8 * GiB,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        super().__init__(sizes={"weights": weights, "kv_cache": kv_cache}, host=host, port=port)
        self.dev_mode = dev_mode
        self.sleep_mode = sleep_mode
        self.pause_modes = pause_modes
        self.level: int | None = None  # the level of the current sleep
        self.sleeping_tags: set[str] = set()  # the parts still asleep
        self.weights_lost = False  # a level-2 sleep discarded the weights and nothing has reloaded them
        self.in_flight = 0  # generation requests running
        self.slept_with_requests = 0  # requests a sleep cut off without aborting or finishing them
        self.draining = False  # a sleep is waiting for the requests in flight to finish

    @property
    def sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    def released(self) -> frozenset[str]:
        return frozenset(self.sleeping_tags)

    def _set_running(self, n: int) -> None:
        self.in_flight = n

    def state(self) -> dict[str, Any]:
        return {
            **super().state(),
            "sleeping": self.sleeping,
            "level": self.level,
            "weights_lost": self.weights_lost,
            "in_flight": self.in_flight,
            "slept_with_requests": self.slept_with_requests,
        }

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
        mode = request.query.get("mode", "abort") if self.pause_modes else None
        if mode is not None and mode not in self.modes:
            # pause_scheduler raises ValueError("Invalid pause mode"), which the route does not catch.
            return web.Response(status=500, text="Internal Server Error")
        if not self.sleep_mode:
            return web.Response(status=500, text="Internal Server Error")
        if self.sleeping:
            return web.Response()  # "Executor is already sleeping": a no-op
        if mode == "wait":
            self.draining = True
            try:
                while self.in_flight and not self._stopping.is_set():
                    await self._until_requests_change()
            finally:
                self.draining = False
        elif mode == "abort":
            self.aborted += self.in_flight
            self.in_flight = 0
        else:  # keep, or a server that knows no modes
            self.slept_with_requests += self.in_flight
        self.level = level
        self.sleeping_tags = {"weights", "kv_cache"}
        self.weights_lost = self.weights_lost or level == 2
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

    async def _collective_rpc(self, request: web.Request) -> web.Response:
        """What a job sends to reload its weights in place after a level-2 sleep."""
        if not self.dev_mode:
            return _not_found()
        body = await request.json()
        if body.get("method") != "reload_weights":
            return _openai_error(400, f"the fake runs only reload_weights, not {body.get('method')!r}")
        if "weights" in self.sleeping_tags:
            return web.Response(status=500, text="Internal Server Error")  # no memory to load into
        self.weights_lost = False
        return web.json_response({"results": [None]})


class FakeSglang(FakeEngine):
    """An SGLang server's memory occupation and generation control routes.

    ``memory_saver=False``: started without ``--enable-memory-saver``: both
    memory calls succeed and free nothing. ``weights_cpu_backup``: whether it
    runs with ``--enable-weights-cpu-backup``; without, a release of the
    weights discards them (``weights_lost``); None: an SGLang before 0.5.3,
    whose settings have no such field (and no backup). ``idle_ignores_paused``:
    an SGLang whose idle check (of the release and the flush) leaves out the
    requests waiting while generation is paused; without, they count as in
    flight. ``server_info=False``: an SGLang from before ``/server_info``, with
    only ``/get_server_info`` (recent ones have both, the old name deprecated).
    ``running`` and ``waiting`` are the requests in the scheduler.
    """

    engine = "sglang"
    all_tags = ("kv_cache", "weights", "cuda_graph")
    routes = (
        ("POST", "/release_memory_occupation"),
        ("GET", "/release_memory_occupation"),
        ("POST", "/resume_memory_occupation"),
        ("GET", "/resume_memory_occupation"),
        ("POST", "/pause_generation"),
        ("POST", "/continue_generation"),
        ("POST", "/flush_cache"),
        ("GET", "/flush_cache"),
        ("GET", "/get_server_info"),
        ("GET", "/server_info"),
        ("POST", "/update_weights_from_disk"),
    )
    pause_modes = ("abort", "retract", "in_place")  # PauseGenerationReqInput.mode

    def __init__(
        self,
        *,
        memory_saver: bool = True,
        weights_cpu_backup: bool | None = True,
        idle_ignores_paused: bool = False,
        server_info: bool = True,
        version: str = "0.5.5",
        weights: int = 4 * GiB,
        kv_cache: int = 8 * GiB,
        cuda_graph: int = 1 * GiB,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        super().__init__(
            sizes={"weights": weights, "kv_cache": kv_cache, "cuda_graph": cuda_graph}, host=host, port=port
        )
        self.memory_saver = memory_saver
        self.weights_cpu_backup = weights_cpu_backup
        self.idle_ignores_paused = idle_ignores_paused
        self.server_info = server_info
        self.version = version
        self.released_tags: set[str] = set()  # what the scheduler counts as released (its offload_tags)
        self.paused = False
        self.running = 0  # requests in the running batch
        self.waiting = 0  # requests in the waiting queue (retracted ones included)
        self.weights_lost = False

    def released(self) -> frozenset[str]:
        return frozenset(self.released_tags) if self.memory_saver else frozenset()

    def _set_running(self, n: int) -> None:
        self.running = n

    def idle(self) -> bool:
        """The scheduler's idle check, as the release asserts it and the flush tests it."""
        waiting_counts = not (self.paused and self.idle_ignores_paused)
        return self.running == 0 and not (waiting_counts and self.waiting)

    def state(self) -> dict[str, Any]:
        return {
            **super().state(),
            "paused": self.paused,
            "running": self.running,
            "waiting": self.waiting,
            "weights_lost": self.weights_lost,
        }

    async def _server_info(self, request: web.Request) -> web.Response:
        if not self.server_info:
            return _not_found()
        return await self._get_server_info(request)

    async def _get_server_info(self, request: web.Request) -> web.Response:
        # The real route returns dataclasses.asdict(server_args), the scheduler's info and the version.
        info: dict[str, Any] = {
            "model_path": "fake/model",
            "enable_memory_saver": self.memory_saver,
            "max_total_num_tokens": 65536,
            "internal_states": [{}],
            "version": self.version,
        }
        if self.weights_cpu_backup is not None:
            info["enable_weights_cpu_backup"] = self.weights_cpu_backup
        return web.json_response(info)

    async def _pause_generation(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if isinstance(body, web.Response):
            return body
        mode = body.get("mode", "abort")
        if mode not in self.pause_modes:
            return _validation_error(f"Invalid mode: {mode!r}. Expected one of {list(self.pause_modes)}.")
        self.paused = True
        if mode == "abort":
            self.aborted += self.running + self.waiting
            self.running = self.waiting = 0
        elif mode == "retract":
            self.waiting += self.running  # their KV cache is freed; recomputed after the continue
            self.running = 0
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue_generation(self, request: web.Request) -> web.Response:
        self.paused = False
        self.running += self.waiting  # the scheduler takes the queue up again
        self.waiting = 0
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _flush_cache(self, request: web.Request) -> web.Response:
        text = (
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"
        )
        return web.Response(status=200 if self.idle() else 400, text=text)

    async def _release_memory_occupation(self, request: web.Request) -> web.Response:
        tags = await self._tags(request)
        if isinstance(tags, web.Response):
            return tags
        if not self.idle():
            raise _Crash(
                "AssertionError: release_memory_occupation should be called only when server is idle "
                f"({self.running} running, {self.waiting} waiting)"
            )
        twice = sorted(set(tags) & self.released_tags)
        if twice:
            return _sglang_error(f"memory of {twice} is already released")
        self.released_tags |= set(tags)  # an unknown tag is recorded and frees nothing, as in SGLang
        if "weights" in tags and self.memory_saver and not self.weights_cpu_backup:
            self.weights_lost = True
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

    async def _update_weights_from_disk(self, request: web.Request) -> web.Response:
        """What a job sends to reload its weights after a release without a backup."""
        if "weights" in self.released():
            return web.json_response({"success": False, "message": "weights are released"}, status=400)
        self.weights_lost = False
        return web.json_response({"success": True, "message": "Succeeded", "num_paused_requests": 0})

    async def _tags(self, request: web.Request) -> list[str] | web.Response:
        """The request's tags (all parts when it names none), or the 400 SGLang answers a bad body with."""
        body = await _json_body(request, required=True)
        if isinstance(body, web.Response):
            return body
        tags = body.get("tags")
        if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
            return _validation_error("tags: Input should be a valid list of strings")
        return list(tags) if tags else list(self.all_tags)


async def _json_body(request: web.Request, *, required: bool = False) -> dict[str, Any] | web.Response:
    raw = await request.read()
    if not raw and not required:
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        return _validation_error("body: a JSON object is required")
    if not isinstance(body, dict):
        return _validation_error("body: Input should be a valid dictionary")
    return body


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
            dev_mode=not args.no_dev_mode,
            sleep_mode=not args.no_sleep_mode,
            pause_modes=not args.no_pause_modes,
            host=args.host,
            port=args.port,
        )
    else:
        fake = FakeSglang(
            memory_saver=not args.no_memory_saver,
            weights_cpu_backup=not args.no_weights_cpu_backup,
            idle_ignores_paused=args.idle_ignores_paused,
            host=args.host,
            port=args.port,
        )
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
    parser.add_argument("--no-pause-modes", action="store_true", help="vllm: a version whose /sleep ignores mode")
    parser.add_argument("--no-memory-saver", action="store_true", help="sglang: without --enable-memory-saver")
    parser.add_argument(
        "--no-weights-cpu-backup", action="store_true", help="sglang: without --enable-weights-cpu-backup"
    )
    parser.add_argument(
        "--idle-ignores-paused", action="store_true", help="sglang: a release accepts requests a pause retracted"
    )
    asyncio.run(_serve(parser.parse_args(argv)))


if __name__ == "__main__":
    main(sys.argv[1:])
