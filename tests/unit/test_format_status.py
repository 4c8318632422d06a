"""`timesliced status`'s text: what a person reads first."""

from __future__ import annotations

from timesliced.cli import format_status

from ..helpers.evolving_source import EvolvingSource


def test_memory_that_parked_jobs_hold_on_a_simulated_gpu_is_named_with_its_job() -> None:
    status = EvolvingSource().status()
    assert "parked jobs hold" not in format_status(status)
    status["parking"]["sim_held"] = {
        "a": {"bytes": 4 << 20, "unfinished": True},
        "b": {"bytes": 2 << 20, "unfinished": False},
    }
    line = next(x for x in format_status(status).splitlines() if "parked jobs hold" in x)
    assert line.endswith(": a 4.0 MiB (its park unfinished), b 2.0 MiB")
