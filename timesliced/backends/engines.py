"""Parking a job through its inference engines' own sleep endpoints (vLLM, SGLang).

An inference engine that the job runs as a server owns its device memory, so
this backend parks nothing itself: it asks each engine replica over HTTP to
let go of its memory, and later to take it back.

- vLLM: ``POST /sleep?level=N`` and ``POST /wake_up`` (``?tags=`` once per
  tag, to wake only some parts); ``GET /is_sleeping``. The server has these
  routes only when started with ``VLLM_SERVER_DEV_MODE=1``, and can sleep
  only with ``--enable-sleep-mode``. Level 1 keeps the weights in host
  memory, level 2 discards them. Both calls are no-ops in the state they lead
  to (sleeping while asleep, waking while awake), and a wake naming a tag
  that is not asleep is ignored, so this backend refuses unknown tags before
  sending anything. Tags only limit what a wake brings back: the engine
  still counts as asleep until the rest is woken, and sleeping it again does
  nothing, so a job that is restored with tags must wake the rest itself
  before it yields again.
- SGLang: ``POST /release_memory_occupation`` and
  ``POST /resume_memory_occupation``, JSON body ``{"tags": [...]}`` or ``{}``
  for everything. Memory is really freed only when the server runs with
  ``--enable-memory-saver``; without it both calls succeed and free nothing.
  A resume must name exactly what was released, so restore sends the tags
  snapshot sent.

A job may run several replicas; each move calls all of them at once. The
move is all or nothing as far as the engines let it be: when some replica
fails, the ones that did move are moved back (best effort, bounded), so a
failed snapshot leaves the job resident and a failed restore leaves it parked.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import aiohttp
from yarl import URL

from timesliced import errors
from timesliced.backends.base import GpuMemory, JobTarget, MoveResult
from timesliced.wire.park import ParkSpec

log = logging.getLogger(__name__)

_EXCERPT = 200  # characters of an error answer's body quoted in messages


class _Outcome(enum.Enum):
    DONE = "done"  # the engine answered 2xx: the step happened
    REFUSED = "refused"  # the engine answered 4xx: the step did not happen
    UNKNOWN = "unknown"  # no answer, a 5xx or cancelled: it may have happened, in part or whole


@dataclass(frozen=True)
class _Request:
    endpoint: URL  # the replica's base URL, which messages name
    method: str
    url: URL
    json: dict[str, Any] | None = None


_Step = Callable[[URL, ParkSpec], _Request]


class EngineBackend:
    """The common part of :class:`VllmBackend` and :class:`SglangBackend`.

    ``timeout`` bounds each HTTP call of a move (sleeping or waking a big
    model can take a minute or more); ``rollback_timeout`` bounds each call
    that undoes part of a failed move. With ``memory``, moves measure the
    device memory of the job's processes before and after, so results carry
    the bytes freed or taken back and the job's resident footprint.
    """

    name: ClassVar[str]
    engine: ClassVar[str]  # the engine's name in messages
    known_tags: ClassVar[frozenset[str]]  # the parts the engine can park separately
    # Whether the undo of a step is harmless on a replica that may not have
    # taken the step (its call timed out or lost its connection). Only then
    # are such replicas included in a rollback.
    undo_is_idempotent: ClassVar[bool]
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

    # --- the Backend protocol ----------------------------------------------------------

    async def snapshot(self, job: JobTarget) -> MoveResult:
        """Ask every replica of ``job`` to release its device memory.

        Raises BackendError for a job without valid endpoints or with options
        the engine cannot honour (nothing is sent then), BackendTimeout when a
        replica did not answer in time, and EndpointError when one refused or
        could not be reached. In every failure the replicas that did sleep are
        woken again first; the message says if that failed too.
        """
        return await self._move(job, "snapshot", self._park, self._unpark)

    async def restore(self, job: JobTarget) -> MoveResult:
        """Ask every replica of ``job`` to take its device memory back.

        Raises as :meth:`snapshot` does; on failure the replicas that did
        wake are put back to sleep first.
        """
        return await self._move(job, "restore", self._unpark, self._park)

    async def reclaim(self, job: JobTarget) -> None:
        """Forget ``job``; its engines own their memory and free it when they exit."""
        self._state.pop(job.name, None)

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

    def _park(self, endpoint: URL, park: ParkSpec) -> _Request:
        raise NotImplementedError

    def _unpark(self, endpoint: URL, park: ParkSpec) -> _Request:
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

    # --- moves -------------------------------------------------------------------------

    async def _move(self, job: JobTarget, kind: str, forward: _Step, undo: _Step) -> MoveResult:
        endpoints = self._endpoints(job)
        self._check_park(job)
        if self._closed:
            raise errors.BackendError(f"the {self.name} backend is closed")
        if job.name in self._busy:
            raise errors.BackendError(f"job {job.name!r} is already being moved by the {self.name} backend")
        self._busy.add(job.name)
        try:
            start = time.perf_counter()
            before = self._measure(job)
            outcomes: dict[URL, _Outcome] = dict.fromkeys(endpoints, _Outcome.UNKNOWN)
            failures: dict[URL, errors.TimeslicedError] = {}
            try:
                await self._fan_out(forward, endpoints, job.park, self.timeout, outcomes, failures)
            except asyncio.CancelledError:
                # The caller gave up (its own timeout): undo what may have happened, then go.
                note = await self._roll_back(kind, undo, endpoints, job.park, outcomes)
                log.warning("%s of job %r was cancelled%s", kind, job.name, f"; {note}" if note else "")
                raise
            if failures:
                note = await self._roll_back(kind, undo, endpoints, job.park, outcomes)
                raise self._failure(job, kind, len(endpoints), failures, note)
            after = self._measure(job)
            seconds = time.perf_counter() - start
        finally:
            self._busy.discard(job.name)
        self._state[job.name] = "parked" if kind == "snapshot" else "resident"
        return self._result(job, kind, before, after, seconds)

    async def _fan_out(
        self,
        step: _Step,
        endpoints: tuple[URL, ...],
        park: ParkSpec,
        timeout: float,
        outcomes: dict[URL, _Outcome],
        failures: dict[URL, errors.TimeslicedError],
    ) -> None:
        """Take ``step`` on every endpoint at once, recording each outcome as it comes in."""

        async def one(endpoint: URL) -> None:
            try:
                await self._send(step(endpoint, park), timeout)
            except errors.TimeslicedError as exc:
                status = exc.details.get("status")
                refused = isinstance(status, int) and 400 <= status < 500
                outcomes[endpoint] = _Outcome.REFUSED if refused else _Outcome.UNKNOWN
                failures[endpoint] = exc
            else:
                outcomes[endpoint] = _Outcome.DONE

        results = await asyncio.gather(*(one(e) for e in endpoints), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r  # a bug, not an engine's answer

    async def _roll_back(
        self,
        kind: str,
        undo: _Step,
        endpoints: tuple[URL, ...],
        park: ParkSpec,
        outcomes: Mapping[URL, _Outcome],
    ) -> str:
        """Undo the step where it happened (or may have, if undoing is harmless); say what came of it."""
        targets = tuple(
            e
            for e in endpoints
            if outcomes[e] is _Outcome.DONE or (outcomes[e] is _Outcome.UNKNOWN and self.undo_is_idempotent)
        )
        unsure = [str(e) for e in endpoints if outcomes[e] is _Outcome.UNKNOWN and e not in targets]
        done, to_do = ("woke", "wake") if kind == "snapshot" else ("put", "put")
        again = "again" if kind == "snapshot" else "back to sleep"
        notes = []
        if targets:
            undone: dict[URL, _Outcome] = dict.fromkeys(targets, _Outcome.UNKNOWN)
            failed: dict[URL, errors.TimeslicedError] = {}
            await self._fan_out(undo, targets, park, self.rollback_timeout, undone, failed)
            ok = [str(e) for e in targets if e not in failed]
            if ok:
                notes.append(f"{done} {', '.join(ok)} {again}")
            if failed:
                notes.append(
                    f"could not {to_do} "
                    + "; ".join(f"{e} ({exc.message})" for e, exc in failed.items())
                    + f" {again}: the job's replicas are now in different states"
                )
        if unsure:
            notes.append(f"the state of {', '.join(unsure)} is unknown")
        return "; ".join(notes)

    def _failure(
        self,
        job: JobTarget,
        kind: str,
        total: int,
        failures: dict[URL, errors.TimeslicedError],
        note: str,
    ) -> errors.BackendError:
        first = next(iter(failures.values()))
        if len(failures) == 1 and total == 1:
            what = first.message
        else:
            listed = "; ".join(exc.message for exc in failures.values())
            what = f"{len(failures)} of {total} {self.engine} replicas failed: {listed}"
        message = f"{kind} of job {job.name!r} failed: {what}" + (f" ({note})" if note else "")
        timeouts = all(isinstance(exc, errors.BackendTimeout) for exc in failures.values())
        cls: type[errors.BackendError] = errors.BackendTimeout if timeouts else errors.EndpointError
        exc = cls(message, job=job.name, endpoints=[str(e) for e in failures])
        exc.__cause__ = first
        return exc

    # --- HTTP --------------------------------------------------------------------------

    async def _send(self, request: _Request, timeout: float) -> str:
        """One call; its answer's body if 2xx, else BackendTimeout or EndpointError.

        EndpointError carries the HTTP ``status`` in its details when the engine answered.
        """
        where = f"{request.method} {request.url}"
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


class VllmBackend(EngineBackend):
    """Parks a job through the sleep mode of its vLLM servers (``ParkSpec.level`` 1 or 2)."""

    name = "vllm"
    engine = "vLLM"
    known_tags = frozenset({"weights", "kv_cache"})
    undo_is_idempotent = True
    not_found_hint = (
        "vLLM serves /sleep, /wake_up and /is_sleeping only when started with VLLM_SERVER_DEV_MODE=1 "
        "and --enable-sleep-mode"
    )
    levels: ClassVar[tuple[int, ...]] = (1, 2)

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

    def _park(self, endpoint: URL, park: ParkSpec) -> _Request:
        return _Request(endpoint, "POST", (endpoint / "sleep").with_query(level=str(park.level)))

    def _unpark(self, endpoint: URL, park: ParkSpec) -> _Request:
        return _Request(endpoint, "POST", (endpoint / "wake_up").with_query([("tags", t) for t in park.tags]))

    async def is_sleeping(self, endpoint: str) -> bool:
        """Ask one vLLM server whether it sleeps (even in part); raises as a move does."""
        url = self._base_url(endpoint)
        request = _Request(url, "GET", url / "is_sleeping")
        body = await self._send(request, self.timeout)
        try:
            answer = json.loads(body)
        except ValueError:
            answer = body
        if not (isinstance(answer, dict) and isinstance(answer.get("is_sleeping"), bool)):
            raise errors.EndpointError(
                f'GET {request.url} answered {body[:_EXCERPT]!r}, not {{"is_sleeping": true|false}}',
                endpoint=str(url),
            )
        return answer["is_sleeping"] is True


class SglangBackend(EngineBackend):
    """Parks a job by releasing the memory occupation of its SGLang servers."""

    name = "sglang"
    engine = "SGLang"
    known_tags = frozenset({"weights", "kv_cache", "cuda_graph"})
    # A resume of something not released (or a second release) is an error in the
    # engine's scheduler, so only replicas known to have moved are moved back.
    undo_is_idempotent = False
    not_found_hint = "is this an SGLang server recent enough to have /release_memory_occupation?"
    nothing_freed_hint = "was the SGLang server started with --enable-memory-saver?"

    def _park(self, endpoint: URL, park: ParkSpec) -> _Request:
        return _Request(endpoint, "POST", endpoint / "release_memory_occupation", self._body(park))

    def _unpark(self, endpoint: URL, park: ParkSpec) -> _Request:
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
