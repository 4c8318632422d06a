"""The docs: the generated reference is current, every relative link resolves, every error code is explained."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from timesliced import docs_reference, errors
from timesliced.docs_reference import COMMAND, cli_markdown, errors_markdown, pages, slug, stale

from ..helpers.doclinks import anchors, broken, heading_text, links

REPO = Path(__file__).resolve().parents[2]


def doc_files() -> list[Path]:
    found = [REPO / "README.md", REPO / "CHANGELOG.md", REPO / "CONTRIBUTING.md"]
    found += sorted((REPO / "docs").rglob("*.md")) + sorted((REPO / "packaging").rglob("*.md"))
    return [p for p in found if p.is_file()]


# --- the generated reference ---------------------------------------------------------------------


def test_the_reference_pages_are_current() -> None:
    old = stale(REPO, pages())
    assert old == [], f"{', '.join(map(str, old))} stale: run `{COMMAND}` and commit the result"


def test_a_changed_or_missing_page_is_stale(tmp_path: Path) -> None:
    expected = {Path("docs/reference/a.md"): "one\n", Path("docs/reference/b.md"): "two\n"}
    (tmp_path / "docs/reference").mkdir(parents=True)
    (tmp_path / "docs/reference/a.md").write_text("one\n")
    assert stale(tmp_path, expected) == [Path("docs/reference/b.md")]
    (tmp_path / "docs/reference/b.md").write_text("two, edited by hand\n")
    assert stale(tmp_path, expected) == [Path("docs/reference/b.md")]
    assert docs_reference.main(["--root", str(tmp_path)]) == 0  # writes the real pages there
    assert docs_reference.main(["--root", str(tmp_path), "--check"]) == 0
    (tmp_path / docs_reference.CLI_PAGE).write_text("old\n")
    assert docs_reference.main(["--root", str(tmp_path), "--check"]) == 1


def test_the_cli_page_does_not_depend_on_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    before = cli_markdown()
    monkeypatch.setenv("TIMESLICED_STATE_DIR", "/somewhere/else")
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/4242")
    monkeypatch.setenv("COLUMNS", "37")
    assert cli_markdown() == before
    assert "/somewhere/else" not in before and "/run/user" not in before
    assert "$XDG_RUNTIME_DIR/timesliced" in before


def test_the_cli_page_walks_every_subparser_whatever_its_depth() -> None:
    parser = argparse.ArgumentParser(prog="tool", description="A tool.")
    parser.add_argument("--verbose", action="store_true", help="say more")
    sub = parser.add_subparsers(dest="command")
    one = sub.add_parser("one", help="the first")
    one.add_argument("path", help="a file")
    one.add_argument("--size", default="1GiB", metavar="SIZE", help="at most %(default)s | or less")
    deep = sub.add_parser("two", help="the second").add_subparsers(dest="deep").add_parser("three", help="nested")
    grouped = deep.add_argument_group("tuning")
    grouped.add_argument("--rate", type=float, default=2.0, choices=[1.0, 2.0], help="one of %(choices)s")
    deep.add_argument("command", nargs=argparse.REMAINDER, metavar="CMD", help="what to run")
    page = cli_markdown(parser)
    headings = re.findall(r"^## `(.+)`$", page, re.M)
    assert headings == ["tool", "tool one", "tool two", "tool two three"]
    assert "| `--size SIZE` | `1GiB` | at most 1GiB \\| or less |" in page
    assert "| `path` |  | a file |" in page
    assert "*tuning*" in page and "one of 1.0, 2.0" in page
    assert "| `CMD ...` |  | what to run |" in page
    assert "`tool two three [options] CMD ...`" in page and "`tool [options] COMMAND ...`" in page
    assert "[`tool two three`](#tool-two-three)" in page
    assert broken_anchors_within(page) == []


def broken_anchors_within(page: str) -> list[str]:
    headings = {slug(heading_text(h)) for h in re.findall(r"^#+ (.+)$", page, re.M)}
    return [a for a in re.findall(r"\]\(#([^)]+)\)", page) if a not in headings]


def test_the_cli_page_has_every_command_of_the_real_parser() -> None:
    from timesliced.cli import build_parser

    def commands(parser: argparse.ArgumentParser, words: list[str]) -> list[str]:
        out = [" ".join(words)]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    out += commands(child, [*words, name])
        return out

    page = cli_markdown()
    for command in commands(build_parser(), ["timesliced"]):
        assert f"## `{command}`" in page
    assert "`--max-slice [GROUP=]S[:ACTION]`" in page


def test_the_errors_page_has_every_code_with_its_class_and_parent() -> None:
    page = errors_markdown()
    for code, cls in errors.ERRORS_BY_CODE.items():
        parent = cls.__bases__[0].__name__
        assert re.search(rf"`{code}` \| `{cls.__name__}` \| `{parent}` \|", page), code
    assert re.search(r"`park_refused` \| `ParkRefused` \| `BackendError` \| yes \|", page)
    assert re.search(r"`backend_timeout` \| `BackendTimeout` \| `BackendError` \|  \|", page)


# --- links -----------------------------------------------------------------------------------------


def test_every_relative_link_in_the_docs_resolves() -> None:
    files = doc_files()
    assert REPO / "README.md" in files and len(files) > 5
    assert broken(files) == []


def test_the_link_check_finds_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("# Title\n\n## The `run` command (new)\n\n## Title\n")
    (tmp_path / "a.md").write_text(
        "See [b](sub/b.md), [run](sub/b.md#the-run-command-new), [again](sub/b.md#title-1),\n"
        "[here](#local) and [gone](sub/c.md), [no anchor](sub/b.md#nope), [web](https://example.com/x.md).\n"
        "[ref]: sub/missing.md\n"
        '<a id="local"></a>\n'
        "```\n[in code](nowhere.md)\n```\n"
        "and `[in a span](nowhere.md)`.\n"
    )
    assert [str(link.target) for link in links(tmp_path / "a.md")] == [
        "sub/b.md",
        "sub/b.md#the-run-command-new",
        "sub/b.md#title-1",
        "#local",
        "sub/c.md",
        "sub/b.md#nope",
        "sub/missing.md",
    ]
    assert anchors(tmp_path / "sub" / "b.md") == {"title", "the-run-command-new", "title-1"}
    found = broken([tmp_path / "a.md"])
    assert len(found) == 3
    assert "sub/c.md: no such file" in found[0]
    assert "#nope" in found[1]
    assert "sub/missing.md: no such file" in found[2]


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Quick start", "quick-start"),
        ("`timesliced run`", "timesliced-run"),
        ("Co-residency and prefetch", "co-residency-and-prefetch"),
        ("What `insufficient_host_memory` means", "what-insufficient_host_memory-means"),
        ("vllm / sglang", "vllm--sglang"),
        ("[Linked](x.md) heading", "linked-heading"),
        ("GPU check: 270 s, driver >= 570", "gpu-check-270-s-driver--570"),
    ],
)
def test_anchors_follow_githubs_slugs(heading: str, anchor: str) -> None:
    assert slug(heading_text(heading)) == anchor


# --- the guide explains every error code -----------------------------------------------------------


def test_troubleshooting_has_a_section_for_every_error_code() -> None:
    page = REPO / "docs" / "guide" / "troubleshooting.md"
    sections = set(re.findall(r"^#{2,4} `([a-z_]+)`", page.read_text(), re.M))
    assert set(errors.ERRORS_BY_CODE) - sections == set(), "explain these codes in docs/guide/troubleshooting.md"
    assert sections - set(errors.ERRORS_BY_CODE) == set(), "these sections name no error code"


def test_the_readme_keeps_the_two_set_up_commands_that_ci_runs() -> None:
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```sh\n(.*?)\n```", readme, re.S)
    assert blocks[:2] == ["pip install . && timesliced demo", "pip install '.[test]' && python -m pytest"]
    assert blocks[1] in (REPO / ".ci" / "run").read_text().splitlines()  # CI runs the README's test command verbatim
