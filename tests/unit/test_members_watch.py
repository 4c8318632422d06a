"""``MembersWatch``: under ``--dns``, the members the name lists now against those the daemon started with."""

from __future__ import annotations

import logging

import pytest

from timesliced.daemon.members_watch import MembersWatch


def watch(answers: list[list[str] | OSError]) -> MembersWatch:
    def resolve(name: str) -> list[str]:
        assert name == "svc"
        answer = answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer

    return MembersWatch("svc", 7713, ["10.0.0.2", "10.0.0.1"], resolve=resolve, clock=lambda: 1234.5)


def test_a_name_that_lists_the_members_agrees_and_says_nothing(caplog: pytest.LogCaptureFixture) -> None:
    w = watch([["10.0.0.1", "10.0.0.2"]])
    caplog.set_level(logging.INFO)
    look = w.look()
    assert look == {
        "name": "svc",
        "listed": ["10.0.0.1", "10.0.0.2"],
        "differs": False,
        "error": None,
        "checked_at": 1234.5,
    }
    assert w.last == look and caplog.records == []


def test_other_members_are_told_once_with_what_to_do_and_their_end_too(caplog: pytest.LogCaptureFixture) -> None:
    w = watch([["10.0.0.1", "10.0.0.2", "10.0.0.3"], ["10.0.0.1", "10.0.0.2", "10.0.0.3"], ["10.0.0.2", "10.0.0.1"]])
    caplog.set_level(logging.INFO)
    assert w.look()["differs"] is True
    (told,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = told.getMessage()
    assert "now lists 10.0.0.1, 10.0.0.2, 10.0.0.3 (new: 10.0.0.3; gone: none)" in message
    assert "not the members this daemon started with (10.0.0.1, 10.0.0.2)" in message
    assert "Restart every daemon" in message
    caplog.clear()
    assert w.look()["differs"] is True and caplog.records == []  # the same answer again: said already
    assert w.look()["differs"] is False
    assert [r.getMessage() for r in caplog.records] == ["--dns 'svc' lists this daemon's members again"]


def test_a_failed_look_is_kept_and_told_once_per_reason(caplog: pytest.LogCaptureFixture) -> None:
    down = OSError("Temporary failure in name resolution")
    w = watch([down, down, []])
    look = w.look()
    assert look["listed"] is None and look["differs"] is False
    assert "cannot resolve 'svc': Temporary failure in name resolution" in (look["error"] or "")
    w.look()
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert "resolved to no addresses" in (w.look()["error"] or "")
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2
