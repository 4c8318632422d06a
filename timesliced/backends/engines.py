"""Parking a job through its inference engines' own sleep endpoints (vLLM, SGLang).

An inference engine that the job runs as a server owns its device memory, so
this backend parks nothing itself: it asks each engine replica over HTTP to
let go of its memory, and later to take it back. A move on one replica is a
short sequence of calls; each call that changes the engine has an undo.

vLLM (``vllm/entrypoints/serve/sleep/api_router.py``; the routes exist only
with ``VLLM_SERVER_DEV_MODE=1``, and sleeping needs ``--enable-sleep-mode``):

- park: ``POST /sleep?level=N&mode=wait``, then ``GET /is_sleeping`` must
  answer ``{"is_sleeping": true}``. Level 1 keeps the weights in host memory;
  level 2 discards them, so it is refused unless the job registered with
  ``reloads_weights`` (it reloads them itself after every restore). ``mode``
  (the ``PauseMode`` that ``EngineCore.sleep`` hands to ``pause_scheduler``,
  in vLLM since its pause/sleep rework, vllm-project/vllm#34528, 0.17 or
  later) says what happens to the requests in flight: the default ``abort``
  aborts them (their callers get partial output), ``wait`` lets them finish
  first while new ones queue until the wake-up, ``keep`` freezes them. This
  backend sends ``wait``, so the sleep's answer comes once the requests are
  done, within the backend's ``timeout``. Older servers read only ``level``
  and ignore ``mode``: they sleep at once, so there the job must not yield
  with requests in flight.
- unpark: ``POST /wake_up`` (``?tags=`` once per tag, to wake only some
  parts), then ``GET /is_sleeping`` must answer ``false``, or ``true`` when
  the tags leave some part asleep (vLLM reports true until every part is
  woken). Both calls are no-ops in the state they lead to, and a wake naming a
  tag that is not asleep is ignored, so unknown tags are refused before
  anything is sent; the undo of either is harmless where it may not have
  happened.

SGLang (``python/sglang/srt/entrypoints/http_server.py``):

- first park of a job: ``GET /server_info`` (``/get_server_info`` on
  versions before it; the server's ``ServerArgs`` as a map). Without
  ``enable_memory_saver`` a release frees nothing, so the park is refused.
  Without ``enable_weights_cpu_backup`` (SGLang >= 0.5.3;
  older servers have no such field) releasing the weights discards them, so a
  park that releases them is refused unless the job registered with
  ``reloads_weights``.
- park: ``POST /pause_generation {"mode": "retract"}`` (running requests go
  back to the waiting queue; their KV cache is freed and recomputed after the
  continue; new requests wait in the server), then ``POST /flush_cache``,
  then ``POST /release_memory_occupation {"tags": [...]}`` (or ``{}`` for
  everything). The release asserts, inside the scheduler, that the server is
  idle ("release_memory_occupation should be called only when server is
  idle"): a release while requests run kills the scheduler and with it the
  server. SGLang versions differ on whether the requests a pause retracted
  count (sglang#31962, #32153), so the flush is the probe: SGLang flushes
  only when its scheduler passes the same idle check (200, "Cache flushed")
  and answers 400 otherwise; then nothing is released, generation is
  continued and the park fails with what to do. Where the release would
  accept retracted requests but the flush does not, the park is refused
  though it would have been safe. (The flush also empties the prefix cache,
  which a release of the KV cache empties anyway.) Servers from before the
  pause modes ignore the body and abort the requests in flight when paused.
- unpark: ``POST /resume_memory_occupation`` with the tags that were
  released (a resume must name exactly what was released), then
  ``POST /continue_generation {}``. SGLang has no route that tells whether
  its memory is released, so nothing is confirmed after an SGLang move.

A job may run several replicas; each move calls all of them at once. The
move is all or nothing as far as the engines let it be: when some replica
fails, what was done on each replica is undone, latest first (best effort,
bounded), so a failed snapshot leaves the job resident and a failed restore
leaves it parked. vLLM's undos are confirmed with ``/is_sleeping`` like its
moves. When every replica is known to be back where the move began (nothing
was changed, or every undo succeeded), the failure is a ``ParkRefused`` /
``RestoreRefused``: the job stays usable and the scheduler tries again later.
A replica whose answer was lost in a call whose undo is not harmless
(SGLang's release and resume: repeating either breaks the scheduler), or
whose undo failed, is left alone and reported, and the failure faults the job.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import aiohttp
from yarl import URL

from timesliced import errors
from timesliced.backends.base import GpuMemory, JobTarget, MoveResult
from timesliced.wire.park import RELOAD_PROMISE, ParkSpec

log = logging.getLogger(__name__)

_EXCERPT = 200  # characters of an error answer's body quoted in messages


@dataclass(frozen=True)
class _Request:
    endpoint: URL  # the replica's base URL, which messages name
    method: str
    url: URL
    json: dict[str, Any] | None = None

    @property
    def where(self) -> str:
        return f"{self.method} {self.url}"


# What an answer must say for the call to count as done; raises EndpointError when it says otherwise.
_Check = Callable[[_Request, str], None]


@dataclass(frozen=True)
class _Call:
    """One HTTP call of a move on one replica."""

    build: Callable[[URL, ParkSpec], _Request]
    check: _Check | None = None
    refused: str = ""  # what a 4xx answer means, when the engine's own answer does not say it well


@dataclass(frozen=True)
class _Step:
    """A call and the calls that take it back, in order (none: it changes nothing, a read)."""

    call: _Call
    undo: tuple[_Call, ...] = ()
    undo_if_unsure: bool = False  # the undo is harmless where the call may not have happened


@dataclass
class _Replica:
    """How far one replica got in a move."""

    done: list[_Step] = field(default_factory=list)
    unsure: _Step | None = None  # the step in flight, or the one whose answer never came: it may have happened
    failure: errors.TimeslicedError | None = None

    def undo_plan(self) -> list[_Call] | None:
        """The calls that take back what happened, latest first; None if that is unknown."""
        plan: list[_Call] = []
        if self.unsure is not None and self.unsure.undo:
            if not self.unsure.undo_if_unsure:
                return None
            plan.extend(self.unsure.undo)
        for step in reversed(self.done):
            plan.extend(step.undo)
        return plan


class EngineBackend:
    """The common part of :class:`VllmBackend` and :class:`SglangBackend`.

    ``timeout`` bounds each HTTP call of a move (sleeping or waking a big
    model can take a minute or more, and a vLLM sleep first waits for the
    requests in flight); ``rollback_timeout`` bounds each call that undoes
    part of a failed move. With ``memory``, moves measure the device memory of
    the job's processes before and after, so results carry the bytes freed or
    taken back and the job's resident footprint.
    """

    name: ClassVar[str]
    engine: ClassVar[str]  # the engine's name in messages
    known_tags: ClassVar[frozenset[str]]  # the parts the engine can park separately
    # What a 404 from the engine most likely means.
    not_found_hint: ClassVar[str]
    # Why a snapshot may free none of the memory of the job's processes.
    nothing_freed_hint: ClassVar[str] = "is the engine's memory held by other processes than the job registered?"

    def __init__(
        self,
        *,
        timeout: float = 120.0,
        rollback_timeout: float = 30.0,
        memory: GpuMemory | None = None,
    ) -> None:
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, not {timeout}")
        if not rollback_timeout > 0:
            raise ValueError(f"rollback_timeout must be positive, not {rollback_timeout}")
        self.timeout = timeout
        self.rollback_timeout = rollback_timeout
        self._memory = memory
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        self._busy: set[str] = set()  # jobs with a move in flight
        self._state: dict[str, str] = {}  # job -> "resident" or "parked", after its last good move
        self._checked: dict[str, set[URL]] = {}  # job -> replicas whose settings passed the first park's check

    # --- the Backend protocol ----------------------------------------------------------

    async def snapshot(self, job: JobTarget) -> MoveResult:
        """Ask every replica of ``job`` to release its device memory.

        Raises BackendError for a job without valid endpoints, with options
        the engine cannot honour or with engines whose settings would lose its
        state (nothing is changed then), BackendTimeout when a replica did not
        answer in time, and EndpointError when one refused, could not be
        reached or answered that it did not move. In every failure what the
        replicas did is undone first; the message says if that failed too.
        """
        return await self._move(job, "snapshot")

    async def restore(self, job: JobTarget) -> MoveResult:
        """Ask every replica of ``job`` to take its device memory back.

        Raises as :meth:`snapshot` does; on failure the replicas that did
        wake are put back to sleep first.
        """
        return await self._move(job, "restore")

    async def reclaim(self, job: JobTarget) -> None:
        """Forget ``job``; its engines own their memory and free it when they exit."""
        self._state.pop(job.name, None)
        self._checked.pop(job.name, None)

    async def aclose(self) -> None:
        """Close the HTTP session; the engines stay as they are. Moves after this raise BackendError."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def job_state(self, job: str) -> str:
        """``resident`` or ``parked`` after the job's last successful move; ``unknown`` before any."""
        return self._state.get(job, "unknown")

    # --- what each engine sends --------------------------------------------------------

    def _steps(self, kind: str, park: ParkSpec) -> tuple[_Step, ...]:
        """The steps of a ``snapshot`` or ``restore`` on one replica, in order."""
        raise NotImplementedError

    def _check_park(self, job: JobTarget) -> None:
        """Raise BackendError for options this engine cannot honour."""
        unknown = sorted(set(job.park.tags) - self.known_tags)
        if unknown:
            raise errors.BackendError(
                f"job {job.name!r}: {self.engine} cannot park {', '.join(map(repr, unknown))}; "
                f"its tags are {', '.join(sorted(self.known_tags))}",
                job=job.name,
            )

    def _check_settings(self, job: JobTarget, endpoint: URL, info: Any) -> str:
        """Why the server's settings (``info``, from ``settings_paths``) make parking ``job`` unsafe; ``""`` if not."""
        return ""

    # The routes that tell the server's settings, newest first (the next is tried on a 404); () for none.
    settings_paths: ClassVar[tuple[str, ...]] = ()

    # --- moves -------------------------------------------------------------------------

    async def _move(self, job: JobTarget, kind: str) -> MoveResult:
        endpoints = self._endpoints(job)
        self._check_park(job)
        if self._closed:
            raise errors.BackendError(f"the {self.name} backend is closed")
        if job.name in self._busy:
            raise errors.BackendError(f"job {job.name!r} is already being moved by the {self.name} backend")
        self._busy.add(job.name)
        try:
            start = time.perf_counter()
            if kind == "snapshot":
                await self._check_servers(job, endpoints)
            before = self._measure(job)
            replicas = {e: _Replica() for e in endpoints}
            try:
                await self._fan_out(self._steps(kind, job.park), replicas, job.park, self.timeout)
            except asyncio.CancelledError:
                # The caller gave up (its own timeout): undo what may have happened, then go.
                note, _ = await self._roll_back(kind, replicas, job.park)
                log.warning("%s of job %r was cancelled%s", kind, job.name, f"; {note}" if note else "")
                self._checked.pop(job.name, None)
                raise
            failures = {e: r.failure for e, r in replicas.items() if r.failure is not None}
            if failures:
                note, whole = await self._roll_back(kind, replicas, job.park)
                self._checked.pop(job.name, None)  # a server that failed may have been restarted otherwise
                raise self._failure(job, kind, len(endpoints), failures, note, whole=whole)
            after = self._measure(job)
            seconds = time.perf_counter() - start
        finally:
            self._busy.discard(job.name)
        self._state[job.name] = "parked" if kind == "snapshot" else "resident"
        return self._result(job, kind, before, after, seconds)

    async def _check_servers(self, job: JobTarget, endpoints: tuple[URL, ...]) -> None:
        """At a job's first park, ask each replica for its settings; refuse (changing nothing) if unsafe."""
        checked = self._checked.setdefault(job.name, set())
        todo = [e for e in endpoints if e not in checked] if self.settings_paths else []
        if not todo:
            return
        answers = await asyncio.gather(*(self._settings(e) for e in todo), return_exceptions=True)
        failures: dict[URL, errors.TimeslicedError] = {}
        refusals: list[str] = []
        for endpoint, answer in zip(todo, answers, strict=True):
            if isinstance(answer, errors.TimeslicedError):
                failures[endpoint] = answer
                continue
            if isinstance(answer, BaseException):
                raise answer  # a bug or a cancellation, not an engine's answer
            where, body = answer
            try:
                info = json.loads(body)
            except ValueError:
                info = None
            if not isinstance(info, dict):
                failures[endpoint] = errors.EndpointError(
                    f"{where} answered {body[:_EXCERPT]!r}, not a map of the server's settings; {self.not_found_hint}",
                    endpoint=str(endpoint),
                )
                continue
            why = self._check_settings(job, endpoint, info)
            if why:
                refusals.append(why)
            else:
                checked.add(endpoint)
        if refusals:
            raise errors.ParkRefused(
                f"snapshot of job {job.name!r} refused, nothing was changed: " + "; ".join(refusals),
                job=job.name,
            )
        if failures:
            raise self._failure(job, "snapshot", len(endpoints), failures, "nothing was changed", whole=True)

    async def _settings(self, endpoint: URL) -> tuple[str, str]:
        """Where the server's settings came from, and the answer's body."""
        for i, path in enumerate(self.settings_paths):
            request = _Request(endpoint, "GET", endpoint / path)
            try:
                return request.where, await self._send(request, self.timeout)
            except errors.EndpointError as exc:
                if exc.details.get("status") != 404 or i == len(self.settings_paths) - 1:
                    raise
        raise AssertionError("unreachable: settings_paths is not empty")

    async def _fan_out(
        self,
        steps: Sequence[_Step],
        replicas: dict[URL, _Replica],
        park: ParkSpec,
        timeout: float,
    ) -> None:
        """Take ``steps`` on every replica at once, each replica in order, recording how far each got."""

        async def one(endpoint: URL, replica: _Replica) -> None:
            for step in steps:
                replica.unsure = step  # until its answer comes
                try:
                    await self._call(step.call, endpoint, park, timeout)
                except errors.TimeslicedError as exc:
                    status = exc.details.get("status")
                    if isinstance(status, int) and 400 <= status < 500:
                        replica.unsure = None  # the engine refused: the step did not happen
                    elif exc.details.get("answered"):
                        replica.unsure = None  # it answered, and the answer says the step did not lead there
                        replica.done.append(step)
                    replica.failure = exc
                    return
                replica.unsure = None
                replica.done.append(step)

        results = await asyncio.gather(*(one(e, r) for e, r in replicas.items()), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r  # a bug or a cancellation, not an engine's answer

    async def _call(self, call: _Call, endpoint: URL, park: ParkSpec, timeout: float) -> None:
        request = call.build(endpoint, park)
        try:
            body = await self._send(request, timeout)
        except errors.EndpointError as exc:
            status = exc.details.get("status")
            if call.refused and isinstance(status, int) and 400 <= status < 500:
                raise errors.EndpointError(
                    f"{request.where}: {call.refused} (it answered HTTP {status}: {exc.details.get('excerpt', '')})",
                    endpoint=str(endpoint),
                    status=status,
                ) from exc
            raise
        if call.check is not None:
            call.check(request, body)

    async def _roll_back(self, kind: str, replicas: dict[URL, _Replica], park: ParkSpec) -> tuple[str, bool]:
        """Undo what happened on each replica (or may have, if undoing is harmless).

        Returns what came of it, and whether every replica is known to be back where the move began.
        """
        plans = {e: r.undo_plan() for e, r in replicas.items()}
        unsure = [str(e) for e, plan in plans.items() if plan is None]
        targets = {e: plan for e, plan in plans.items() if plan}
        done, to_do = ("woke", "wake") if kind == "snapshot" else ("put", "put")
        again = "again" if kind == "snapshot" else "back to sleep"
        notes = []
        whole = not unsure
        if targets:
            failed: dict[URL, errors.TimeslicedError] = {}

            async def undo(endpoint: URL, plan: list[_Call]) -> None:
                for call in plan:  # stop at the first failure: a later undo may be unsafe without it
                    try:
                        await self._call(call, endpoint, park, self.rollback_timeout)
                    except errors.TimeslicedError as exc:
                        failed[endpoint] = exc
                        return

            results = await asyncio.gather(*(undo(e, p) for e, p in targets.items()), return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException):
                    raise r
            ok = [str(e) for e in targets if e not in failed]
            if ok:
                notes.append(f"{done} {', '.join(ok)} {again}")
            if failed:
                whole = False
                notes.append(
                    f"could not {to_do} "
                    + "; ".join(f"{e} ({exc.message})" for e, exc in failed.items())
                    + f" {again}: the job's replicas are now in different states"
                )
        if unsure:
            notes.append(f"the state of {', '.join(unsure)} is unknown")
        return "; ".join(notes), whole

    def _failure(
        self,
        job: JobTarget,
        kind: str,
        total: int,
        failures: dict[URL, errors.TimeslicedError],
        note: str,
        *,
        whole: bool,
    ) -> errors.BackendError:
        """The error of a failed move: ``ParkRefused`` / ``RestoreRefused`` when every replica is ``whole``
        (back where the move began; ``details["cause"]`` keeps the replicas' error code), else the
        replicas' own error (``BackendTimeout`` or ``EndpointError``), which faults the job."""
        first = next(iter(failures.values()))
        if len(failures) == 1 and total == 1:
            what = first.message
        else:
            listed = "; ".join(exc.message for exc in failures.values())
            what = f"{len(failures)} of {total} {self.engine} replicas failed: {listed}"
        message = f"{kind} of job {job.name!r} failed: {what}" + (f" ({note})" if note else "")
        timeouts = all(isinstance(exc, errors.BackendTimeout) for exc in failures.values())
        cls: type[errors.BackendError] = errors.BackendTimeout if timeouts else errors.EndpointError
        details: dict[str, Any] = {"job": job.name, "endpoints": [str(e) for e in failures]}
        if whole:
            details["cause"] = cls.code
            cls = errors.ParkRefused if kind == "snapshot" else errors.RestoreRefused
        exc = cls(message, **details)
        exc.__cause__ = first
        return exc

    # --- HTTP --------------------------------------------------------------------------

    async def _send(self, request: _Request, timeout: float) -> str:
        """One call; its answer's body if 2xx, else BackendTimeout or EndpointError.

        EndpointError carries the HTTP ``status`` and the body's ``excerpt`` in its
        details when the engine answered.
        """
        where = request.where
        endpoint = str(request.endpoint)
        try:
            async with self._client().request(
                request.method,
                request.url,
                json=request.json,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as response:
                body = await response.text(errors="replace")
        except asyncio.TimeoutError:  # aiohttp's own timeouts are ClientErrors too: check this first
            raise errors.BackendTimeout(
                f"{where}: {self.engine} endpoint {endpoint} did not answer within {timeout:g} s",
                endpoint=endpoint,
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise errors.EndpointError(
                f"{where}: cannot reach {self.engine} endpoint {endpoint}: {exc or type(exc).__name__}",
                endpoint=endpoint,
            ) from exc
        if 200 <= response.status < 300:
            return body
        excerpt = " ".join(body.split())
        if len(excerpt) > _EXCERPT:
            excerpt = excerpt[:_EXCERPT] + "..."
        hint = f" ({self.not_found_hint})" if response.status == 404 else ""
        raise errors.EndpointError(
            f"{where} answered HTTP {response.status} {response.reason or ''}".rstrip()
            + f"{hint}: {excerpt or '(empty body)'}",
            endpoint=endpoint,
            status=response.status,
            excerpt=excerpt,
        )

    def _client(self) -> aiohttp.ClientSession:
        if self._closed:
            raise errors.BackendError(f"the {self.name} backend is closed")
        if self._session is None:
            # Made here, inside the running loop, which the session binds to.
            self._session = aiohttp.ClientSession()
        return self._session

    # --- checks and measurements -------------------------------------------------------

    def _endpoints(self, job: JobTarget) -> tuple[URL, ...]:
        if not job.park.endpoints:
            raise errors.BackendError(
                f"job {job.name!r} is parked by {self.name} but names no endpoints; register it with the "
                f"base URL of each {self.engine} server, such as http://127.0.0.1:8000",
                job=job.name,
            )
        out: list[URL] = []
        for raw in job.park.endpoints:
            url = self._base_url(raw, f"job {job.name!r}: ", job=job.name)
            if url in out:
                raise errors.BackendError(f"job {job.name!r} names endpoint {raw!r} twice", job=job.name)
            out.append(url)
        return tuple(out)

    def _base_url(self, raw: object, context: str = "", **details: Any) -> URL:
        try:
            url = URL(raw.rstrip("/")) if isinstance(raw, str) else None
        except ValueError:
            url = None
        if url is None or url.scheme not in ("http", "https") or not url.host or url.query_string or url.fragment:
            raise errors.BackendError(
                f"{context}endpoint {raw!r} is not the base URL of a {self.engine} server "
                "(http://host:port or https://host:port, optionally with a path prefix)",
                **details,
            )
        return url

    def _measure(self, job: JobTarget) -> dict[int, int] | None:
        """gpu -> bytes that the job's processes hold now; None without a memory source or if it fails."""
        if self._memory is None:
            return None
        try:
            table = self._memory.process_memory()
        except Exception as exc:  # a failed measurement must not fail (or half-fail) a move
            log.warning("cannot measure the device memory of job %r: %s", job.name, exc)
            return None
        out: dict[int, int] = {}
        for pid in job.pids:
            for gpu, nbytes in table.get(pid, {}).items():
                out[gpu] = out.get(gpu, 0) + nbytes
        return out

    def _result(
        self,
        job: JobTarget,
        kind: str,
        before: dict[int, int] | None,
        after: dict[int, int] | None,
        seconds: float,
    ) -> MoveResult:
        if before is None or after is None:
            return MoveResult(0, seconds)
        resident, parked = (before, after) if kind == "snapshot" else (after, before)
        moved = max(0, sum(resident.values()) - sum(parked.values()))
        if kind == "snapshot" and moved == 0 and sum(resident.values()) > 0:
            log.warning(
                "snapshot of job %r freed no device memory of its processes %s; %s",
                job.name,
                list(job.pids),
                self.nothing_freed_hint,
            )
        return MoveResult(moved, seconds, resident)


# --- vLLM ----------------------------------------------------------------------------------


def _parse_is_sleeping(request: _Request, body: str) -> bool:
    """The answer of ``GET /is_sleeping``: ``{"is_sleeping": true|false}``; raises EndpointError otherwise."""
    try:
        answer = json.loads(body)
    except ValueError:
        answer = body
    if not (isinstance(answer, dict) and isinstance(answer.get("is_sleeping"), bool)):
        raise errors.EndpointError(
            f'{request.where} answered {body[:_EXCERPT]!r}, not {{"is_sleeping": true|false}}',
            endpoint=str(request.endpoint),
        )
    return answer["is_sleeping"] is True


def _expect_sleeping(expected: bool, after: str) -> _Check:
    def check(request: _Request, body: str) -> None:
        if _parse_is_sleeping(request, body) == expected:
            return
        state = "still awake" if expected else "still asleep"
        raise errors.EndpointError(
            f'{request.where} answered {{"is_sleeping": {str(not expected).lower()}}} after {after} '
            f"answered success: the engine is {state}; look at the server's log (does it run with "
            "--enable-sleep-mode, and is another client sleeping or waking it?)",
            endpoint=str(request.endpoint),
            answered=True,
        )

    return check


class VllmBackend(EngineBackend):
    """Parks a job through the sleep mode of its vLLM servers (``ParkSpec.level`` 1 or 2)."""

    name = "vllm"
    engine = "vLLM"
    known_tags = frozenset({"weights", "kv_cache"})
    not_found_hint = (
        "vLLM serves /sleep, /wake_up and /is_sleeping only when started with VLLM_SERVER_DEV_MODE=1 "
        "and --enable-sleep-mode"
    )
    levels: ClassVar[tuple[int, ...]] = (1, 2)
    # What a sleep does with the requests in flight: let them finish (see the module's docstring).
    sleep_mode: ClassVar[str] = "wait"

    def _check_park(self, job: JobTarget) -> None:
        super()._check_park(job)
        # vLLM does not check the level: any other number discards the weights as
        # level 2 does (recent versions take 0 to pause scheduling only).
        if job.park.level not in self.levels:
            raise errors.BackendError(
                f"job {job.name!r}: vLLM sleep level must be 1 (keep weights in host memory) "
                f"or 2 (discard them), not {job.park.level!r}",
                job=job.name,
            )
        if job.park.level == 2 and not job.park.reloads_weights:
            raise errors.BackendError(
                f"job {job.name!r}: vLLM sleep level 2 discards the weights; use level 1, or register "
                f"with reloads_weights=True if {RELOAD_PROMISE}",
                job=job.name,
            )

    def _steps(self, kind: str, park: ParkSpec) -> tuple[_Step, ...]:
        sleep, wake_all = _Call(self._sleep), _Call(self._wake_all)
        # Each undo is confirmed too, so a rolled-back move is known to have left the replica whole.
        awake = _Call(self._is_sleeping, _expect_sleeping(False, "POST /wake_up"))
        asleep = _Call(self._is_sleeping, _expect_sleeping(True, "POST /sleep"))
        if kind == "snapshot":
            return (_Step(sleep, (wake_all, awake), undo_if_unsure=True), _Step(asleep))
        # Waking only some parts leaves the engine asleep in part, which is_sleeping reports as asleep.
        partial = bool(park.tags) and not self.known_tags <= set(park.tags)
        confirm = _Call(self._is_sleeping, _expect_sleeping(partial, "POST /wake_up"))
        return (_Step(_Call(self._wake), (sleep, asleep), undo_if_unsure=True), _Step(confirm))

    def _sleep(self, endpoint: URL, park: ParkSpec) -> _Request:
        query = {"level": str(park.level), "mode": self.sleep_mode}
        return _Request(endpoint, "POST", (endpoint / "sleep").with_query(query))

    def _wake(self, endpoint: URL, park: ParkSpec) -> _Request:
        return _Request(endpoint, "POST", (endpoint / "wake_up").with_query([("tags", t) for t in park.tags]))

    def _wake_all(self, endpoint: URL, park: ParkSpec) -> _Request:
        # Undoing a sleep wakes every part: the job was wholly awake before it.
        return _Request(endpoint, "POST", endpoint / "wake_up")

    def _is_sleeping(self, endpoint: URL, park: ParkSpec) -> _Request:
        return _Request(endpoint, "GET", endpoint / "is_sleeping")

    async def is_sleeping(self, endpoint: str) -> bool:
        """Ask one vLLM server whether it sleeps (even in part); raises as a move does."""
        url = self._base_url(endpoint)
        request = self._is_sleeping(url, ParkSpec(self.name))
        return _parse_is_sleeping(request, await self._send(request, self.timeout))


# --- SGLang --------------------------------------------------------------------------------


class SglangBackend(EngineBackend):
    """Parks a job by pausing its SGLang servers and releasing their memory occupation."""

    name = "sglang"
    engine = "SGLang"
    known_tags = frozenset({"weights", "kv_cache", "cuda_graph"})
    not_found_hint = "is this an SGLang server recent enough to have /release_memory_occupation and /pause_generation?"
    nothing_freed_hint = "was the SGLang server started with --enable-memory-saver?"
    # /server_info is the route of recent versions; /get_server_info, its older name, is deprecated there.
    settings_paths = ("server_info", "get_server_info")
    # What a pause does with the requests in flight: put them back in the queue (see the module's docstring).
    pause_mode: ClassVar[str] = "retract"

    def _check_settings(self, job: JobTarget, endpoint: URL, info: Any) -> str:
        version = info.get("version")
        on = f"SGLang server {endpoint}" + (f" (version {version})" if isinstance(version, str) else "")
        if info.get("enable_memory_saver") is not True:
            return (
                f"{on} runs without --enable-memory-saver, so a release frees none of its device memory "
                "and the job that takes the GPU next would run out of it: restart the server with "
                "--enable-memory-saver"
            )
        releases_weights = not job.park.tags or "weights" in job.park.tags
        if releases_weights and not job.park.reloads_weights and info.get("enable_weights_cpu_backup") is not True:
            older = (
                " (its settings have no enable_weights_cpu_backup: SGLang before 0.5.3 cannot keep a copy)"
                if "enable_weights_cpu_backup" not in info
                else ""
            )
            return (
                f"{on} runs without --enable-weights-cpu-backup{older}, so releasing its weights discards "
                "them: restart it with --enable-weights-cpu-backup, park only other parts "
                "(tags kv_cache, cuda_graph), or register with reloads_weights=True if "
                f"{RELOAD_PROMISE}"
            )
        return ""

    def _steps(self, kind: str, park: ParkSpec) -> tuple[_Step, ...]:
        pause, resume_generation = _Call(self._pause), _Call(self._continue)
        idle = _Call(
            self._flush,
            refused=(
                "the server is not idle even with generation paused: its scheduler still holds requests "
                "(retracted or queued), and a release now would fail the scheduler's idle assertion and "
                "take the server down, so nothing was released; let the job's requests finish (or abort "
                "them) before it yields, or run an SGLang whose release accepts requests a pause retracted"
            ),
        )
        release, resume = _Call(self._release), _Call(self._resume)
        if kind == "snapshot":
            return (
                _Step(pause, (resume_generation,), undo_if_unsure=True),
                _Step(idle),
                # A second release, or a resume of what was not released, breaks the scheduler.
                _Step(release, (resume,)),
            )
        return (
            _Step(resume, (idle, release)),
            _Step(resume_generation, (pause,), undo_if_unsure=True),
        )

    def _pause(self, endpoint: URL, park: ParkSpec) -> _Request:
        return _Request(endpoint, "POST", endpoint / "pause_generation", {"mode": self.pause_mode})

    def _continue(self, endpoint: URL, park: ParkSpec) -> _Request:
        # Recent versions parse a (possibly empty) JSON body; older ones ignore it.
        return _Request(endpoint, "POST", endpoint / "continue_generation", {})

    def _flush(self, endpoint: URL, park: ParkSpec) -> _Request:
        return _Request(endpoint, "POST", endpoint / "flush_cache")

    def _release(self, endpoint: URL, park: ParkSpec) -> _Request:
        return _Request(endpoint, "POST", endpoint / "release_memory_occupation", self._body(park))

    def _resume(self, endpoint: URL, park: ParkSpec) -> _Request:
        return _Request(endpoint, "POST", endpoint / "resume_memory_occupation", self._body(park))

    @staticmethod
    def _body(park: ParkSpec) -> dict[str, Any]:
        # The route requires a JSON body even when it names nothing.
        return {"tags": list(park.tags)} if park.tags else {}


BACKENDS: dict[str, type[EngineBackend]] = {VllmBackend.name: VllmBackend, SglangBackend.name: SglangBackend}


def make_engine_backend(method: str, **settings: Any) -> EngineBackend:
    """The backend for ``method`` (``vllm`` or ``sglang``), with ``settings`` as its constructor's."""
    try:
        cls = BACKENDS[method]
    except KeyError:
        raise ValueError(f"no engine backend {method!r}; choose from {', '.join(BACKENDS)}") from None
    return cls(**settings)
