"""The scenario of ``timesliced bench workload``: jobs, phases and sizes from a small TOML file.

A scenario names GPU memory and copy bandwidth (``[gpus]``), how real minutes and GB map onto the
run (``[scale]``, ``[quick]``) and the jobs (``[[jobs]]``): ``rl`` jobs (a sampler process and a
trainer process: rollout, reward on the CPU, train, weight sync on both GPUs) and ``sft`` jobs
(train steps on the trainer GPU, data loading on the CPU). Phase lengths are minutes and sizes GB
of the real experiment. ``parse`` checks every key and raises ``ValueError`` naming it.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

MiB = 1 << 20
PAGE = 2 * MiB  # the simulated GPU's page (DaemonConfig.page_size): sizes are whole pages
DEFAULT = "published.toml"

RL_PHASES = ("rollout_min", "reward_min", "train_min", "sync_min")
SFT_PHASES = ("train_min", "load_min")


@dataclass(frozen=True)
class Job:
    """One job of the scenario; ``kind`` ``rl`` (sampler + trainer) or ``sft`` (trainer only).

    Phases in real minutes, sizes in real GB; an SFT job has no rollout, reward, sync or sampler state.
    """

    name: str
    kind: str
    iterations: int
    train_min: float
    trainer_gb: float
    rollout_min: float = 0.0
    reward_min: float = 0.0
    sync_min: float = 0.0
    load_min: float = 0.0
    sampler_gb: float = 0.0
    weights_gb: float = 0.0

    @property
    def alone_min(self) -> float:
        """The job's length on GPUs of its own (its phases one after another)."""
        if self.kind == "rl":
            return self.iterations * (self.rollout_min + self.reward_min + self.train_min + self.sync_min)
        return self.iterations * (self.train_min + self.load_min)

    @property
    def trainer_work_min(self) -> float:
        return self.iterations * (self.train_min + self.sync_min)

    @property
    def sampler_work_min(self) -> float:
        return self.iterations * (self.rollout_min + self.sync_min) if self.kind == "rl" else 0.0

    @property
    def workers(self) -> tuple[str, ...]:
        """Its worker processes, each a registered job of its own (``NAME-trainer``, ``NAME-sampler``)."""
        return ("sampler", "trainer") if self.kind == "rl" else ("trainer",)


@dataclass(frozen=True)
class Scenario:
    jobs: tuple[Job, ...]
    gpu_memory_gb: float
    bandwidth_gbps: float
    seconds_per_minute: float
    mib_per_gb: float
    quick_seconds_per_minute: float
    quick_iterations: float
    source: str = "<scenario>"

    # --- what the run takes from it -------------------------------------------------------

    def seconds(self, minutes: float) -> float:
        return minutes * self.seconds_per_minute

    def nbytes(self, gb: float) -> int:
        """Simulated bytes for ``gb`` real GB: whole pages, at least one."""
        return max(1, math.ceil(gb * self.mib_per_gb * MiB / PAGE)) * PAGE

    @property
    def gpu_memory(self) -> int:
        """Simulated bytes per GPU: whole pages, rounded down (a state never fits only by rounding)."""
        return max(1, int(self.gpu_memory_gb * self.mib_per_gb * MiB) // PAGE) * PAGE

    @property
    def sim_bandwidth_gbps(self) -> float:
        """The simulated copy bandwidth (GB/s, for ``serve --bandwidth``) at which a switch takes the
        same share of a phase as in the real experiment: real bandwidth x (bytes scale / time scale)."""
        bytes_scale = self.mib_per_gb * MiB / 1e9  # simulated bytes per real byte
        time_scale = self.seconds_per_minute / 60  # run seconds per real second
        return self.bandwidth_gbps * bytes_scale / time_scale

    @property
    def workers(self) -> int:
        return sum(len(j.workers) for j in self.jobs)

    # --- the bound ------------------------------------------------------------------------

    def gpu_work_min(self) -> dict[str, float]:
        """Real minutes of GPU work on each shared GPU (``trainer``, ``sampler``): syncs count on both."""
        return {
            "trainer": sum(j.trainer_work_min for j in self.jobs),
            "sampler": sum(j.sampler_work_min for j in self.jobs),
        }

    def lower_bound_s(self) -> float:
        """No schedule on the two shared GPUs beats this: the busiest GPU's work, or the longest job alone."""
        busiest = max(self.gpu_work_min().values())
        longest = max(j.alone_min for j in self.jobs)
        return self.seconds(max(busiest, longest))

    def serial_s(self) -> float:
        """The jobs one after another, without any overhead."""
        return self.seconds(sum(j.alone_min for j in self.jobs))

    def quick(self) -> Scenario:
        """The same jobs with ``[quick]``'s clock and share of iterations (at least one each)."""
        jobs = tuple(replace(j, iterations=max(1, round(j.iterations * self.quick_iterations))) for j in self.jobs)
        return replace(self, jobs=jobs, seconds_per_minute=self.quick_seconds_per_minute)


# --- reading and checking ------------------------------------------------------------------


def load(path: str | Path | None = None) -> Scenario:
    """The scenario in ``path``, or the packaged one it names (``short-gaps``; the default when None).

    Raises ``ValueError`` naming the bad key.
    """
    shipped = resources.files("timesliced.bench").joinpath("scenarios")
    name = DEFAULT if path is None else f"{path}.toml"
    if path is None or (not Path(path).exists() and "/" not in str(path) and shipped.joinpath(name).is_file()):
        text = shipped.joinpath(name).read_text()
        source = f"the {'default' if path is None else 'packaged'} scenario ({name})"
    else:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"cannot read the scenario {path}: {exc.strerror or exc}; give a TOML file") from None
        source = str(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{source}: not valid TOML: {exc}") from None
    return parse(data, source)


def parse(data: dict[str, Any], source: str = "<scenario>") -> Scenario:
    """A ``Scenario`` from parsed TOML; raises ``ValueError`` that names the file and the key."""
    r = _Reader(source)
    r.only(data, "", {"gpus", "scale", "quick", "jobs"})
    gpus = r.table(data, "gpus")
    scale = r.table(data, "scale")
    quick = r.table(data, "quick", required=False)
    r.only(gpus, "gpus.", {"memory_gb", "bandwidth_gbps"})
    r.only(scale, "scale.", {"seconds_per_minute", "mib_per_gb"})
    r.only(quick, "quick.", {"seconds_per_minute", "iterations"})
    raw_jobs = data.get("jobs")
    if not isinstance(raw_jobs, list) or not raw_jobs or not all(isinstance(j, dict) for j in raw_jobs):
        raise ValueError(f"{source}: jobs: give at least one [[jobs]] table")
    spm = r.positive(scale, "scale.", "seconds_per_minute")
    scenario = Scenario(
        jobs=tuple(_job(r, j, f"jobs[{i}].") for i, j in enumerate(raw_jobs)),
        gpu_memory_gb=r.positive(gpus, "gpus.", "memory_gb"),
        bandwidth_gbps=r.positive(gpus, "gpus.", "bandwidth_gbps"),
        seconds_per_minute=spm,
        mib_per_gb=r.positive(scale, "scale.", "mib_per_gb"),
        quick_seconds_per_minute=r.positive(quick, "quick.", "seconds_per_minute", default=spm / 10),
        quick_iterations=r.positive(quick, "quick.", "iterations", default=0.3),
        source=source,
    )
    if scenario.quick_iterations > 1:
        raise ValueError(f"{source}: quick.iterations is a share of each job's iterations: give at most 1")
    names = [j.name for j in scenario.jobs]
    if len(set(names)) != len(names):
        raise ValueError(f"{source}: jobs: names must differ, got {names}")
    if not any(j.kind == "rl" for j in scenario.jobs) and not any(j.kind == "sft" for j in scenario.jobs):
        raise ValueError(f"{source}: jobs: give an rl or an sft job")
    _check_fits(scenario)
    return scenario


def _job(r: _Reader, d: dict[str, Any], where: str) -> Job:
    kind = d.get("kind")
    if kind not in ("rl", "sft"):
        raise ValueError(f'{r.source}: {where}kind: give "rl" or "sft", got {kind!r}')
    name = d.get("name")
    if not isinstance(name, str) or not name or not all(c.isalnum() or c in "-_" for c in name):
        raise ValueError(f"{r.source}: {where}name: give a name of letters, digits, '-' and '_', got {name!r}")
    where = f"{where[:-1]} ({name})."
    iterations = d.get("iterations")
    if not isinstance(iterations, int) or isinstance(iterations, bool) or iterations < 1:
        raise ValueError(f"{r.source}: {where}iterations: give a whole number of at least 1, got {iterations!r}")
    common = {"name", "kind", "iterations", "train_min", "trainer_gb"}
    if kind == "rl":
        r.only(d, where, common | set(RL_PHASES) | {"sampler_gb", "weights_gb"})
        job = Job(
            name,
            kind,
            iterations,
            train_min=r.positive(d, where, "train_min"),
            trainer_gb=r.positive(d, where, "trainer_gb"),
            rollout_min=r.positive(d, where, "rollout_min"),
            reward_min=r.positive(d, where, "reward_min", zero=True),
            sync_min=r.positive(d, where, "sync_min"),
            sampler_gb=r.positive(d, where, "sampler_gb"),
            weights_gb=r.positive(d, where, "weights_gb"),
        )
        for state in ("trainer_gb", "sampler_gb"):
            if job.weights_gb > getattr(job, state):
                raise ValueError(f"{r.source}: {where}weights_gb: the weights are part of {state}: give at most that")
        return job
    r.only(d, where, common | set(SFT_PHASES))
    return Job(
        name,
        kind,
        iterations,
        train_min=r.positive(d, where, "train_min"),
        trainer_gb=r.positive(d, where, "trainer_gb"),
        load_min=r.positive(d, where, "load_min", zero=True),
    )


def _check_fits(s: Scenario) -> None:
    for j in s.jobs:
        for state in ("trainer_gb", "sampler_gb"):
            if getattr(j, state) and s.nbytes(getattr(j, state)) > s.gpu_memory:
                raise ValueError(
                    f"{s.source}: jobs ({j.name}).{state}: {getattr(j, state)} GB does not fit on a GPU of "
                    f"gpus.memory_gb = {s.gpu_memory_gb} (in whole {PAGE // MiB} MiB pages at scale.mib_per_gb = "
                    f"{s.mib_per_gb}): give a smaller state or more memory"
                )


class _Reader:
    def __init__(self, source: str) -> None:
        self.source = source

    def table(self, d: dict[str, Any], key: str, required: bool = True) -> dict[str, Any]:
        value = d.get(key)
        if value is None and not required:
            return {}
        if not isinstance(value, dict):
            raise ValueError(f"{self.source}: [{key}]: missing; give the table (see the default scenario)")
        return value

    def only(self, d: dict[str, Any], where: str, known: set[str]) -> None:
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{self.source}: {where}{unknown[0]}: unknown key; known: {', '.join(sorted(known))}")

    def positive(
        self, d: dict[str, Any], where: str, key: str, *, default: float | None = None, zero: bool = False
    ) -> float:
        value = d.get(key, default)
        if value is None:
            raise ValueError(f"{self.source}: {where}{key}: missing; give a number")
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value < 0 or (value == 0 and not zero):
            need = "a number >= 0" if zero else "a number > 0"
            raise ValueError(f"{self.source}: {where}{key}: give {need}, got {value!r}")
        return float(value)
