"""Sizes as users write them (``util.parse``), and as messages show them."""

from __future__ import annotations

import pytest

from timesliced.util.parse import SIZE_FORMS, exact_size, human_size, parse_size, size_value

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("16GiB", 16 * GiB),
        ("512MiB", 512 * MiB),
        ("1.5GB", 3 * GiB // 2),  # every spelling is a power of 1024
        ("1.5G", 3 * GiB // 2),
        ("16gib", 16 * GiB),
        ("16 GiB", 16 * GiB),
        ("  4K ", 4 * KiB),
        ("2T", 2 << 40),
        ("4096", 4096),
        ("100B", 100),
        ("0", 0),
        (".5KiB", 512),
        ("1.", 1),
        ("1.9", 1),  # a fraction of a byte is rounded down
    ],
)
def test_sizes_people_write(text: str, expected: int) -> None:
    assert parse_size(text) == expected


BAD = ["banana", "", "-1", "1e3", "16GiBB", "GiB", "16 Gi B", "1,5GB", "16Xi", "9" * 400 + "T"]


@pytest.mark.parametrize("text", BAD)
def test_a_refused_size_says_what_is_accepted(text: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_size(text)
    assert str(caught.value).startswith(f"not a size: {text!r}") and SIZE_FORMS in str(caught.value)
    assert "16GiB" in SIZE_FORMS and "1.5GB" in SIZE_FORMS and "powers of 1024" in SIZE_FORMS


def test_a_size_value_from_a_file_is_bytes_or_a_size_string() -> None:
    assert size_value(4096) == 4096 and size_value("1MiB") == MiB and size_value(0) == 0
    for bad in (True, -1, 1.5, None, [1]):
        with pytest.raises(ValueError, match="not a size"):
            size_value(bad)


@pytest.mark.parametrize(
    ("n", "shown", "exact"),
    [
        (0, "0 B", "0 B"),
        (1023, "1023 B", "1023 B"),
        (1024, "1.0 KiB", "1.0 KiB (1024 bytes)"),
        (40 * MiB, "40.0 MiB", "40.0 MiB (41943040 bytes)"),
        (3 * GiB // 2, "1.5 GiB", "1.5 GiB (1610612736 bytes)"),
        (5000 << 40, "5000.0 TiB", f"5000.0 TiB ({5000 << 40} bytes)"),
        (-2 * MiB, "-2.0 MiB", "-2.0 MiB (-2097152 bytes)"),
    ],
)
def test_sizes_for_people(n: int, shown: str, exact: str) -> None:
    assert human_size(n) == shown and exact_size(n) == exact


def test_what_is_shown_parses_back_to_about_the_same() -> None:
    for n in (1, 999, 1536, 40 * MiB, 80 * GiB + 123):
        back = parse_size(human_size(n).replace(" ", ""))
        assert abs(back - n) <= n * 0.05
