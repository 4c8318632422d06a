"""Relative links in Markdown files, and whether each resolves: a file or folder, and a heading's anchor.

Anchors follow GitHub's rules (``timesliced.docs_reference.slug``): a heading's text, rendered (links
become their text, code marks and emphasis go), lower-cased, punctuation dropped, spaces turned into
hyphens; a repeated heading gets ``-1``, ``-2``, ... Text in fenced code blocks and code spans is not
Markdown, so links and headings there do not count.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from timesliced.docs_reference import slug

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


@dataclass(frozen=True)
class Link:
    source: Path
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.source}:{self.line}: {self.target}"


def prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, with code spans blanked."""
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1)
                continue
            if m.group(1) == fence:
                fence = None
                continue
        if fence is None:
            yield number, _CODE_SPAN.sub(lambda c: " " * len(c.group(0)), line)


def links(path: Path) -> list[Link]:
    out = []
    for number, line in prose_lines(path.read_text()):
        targets = [m.group(1) for m in _INLINE.finditer(line)]
        ref = _REFERENCE.match(line)
        if ref:
            targets.append(ref.group(1))
        out += [Link(path, number, t) for t in targets if t and not _SCHEME.match(t)]
    return out


def heading_text(raw: str) -> str:
    """A heading as GitHub renders it to text: links become their text, code and emphasis marks go."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", raw)
    text = re.sub(r"<[^>]+>", "", text)
    return text.replace("`", "").replace("*", "")


def anchors(path: Path) -> set[str]:
    """Every anchor that ``path`` has: its headings' slugs (repeats numbered) and HTML anchors."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    text = path.read_text()
    # Headings inside code spans still count: take the heading lines from the text with fences removed.
    fenced = {n for n, _ in prose_lines(text)}
    for number, line in enumerate(text.splitlines(), 1):
        if number not in fenced:
            continue
        found.update(_HTML_ANCHOR.findall(line))
        m = _HEADING.match(line)
        if not m:
            continue
        base = slug(heading_text(m.group(2)))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken(files: Iterable[Path]) -> list[str]:
    """Each relative link in ``files`` that does not resolve, with the reason."""
    out = []
    for path in files:
        for link in links(path):
            target, _, anchor = link.target.partition("#")
            dest = (path.parent / target).resolve() if target else path.resolve()
            if not dest.exists():
                out.append(f"{link}: no such file or folder")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                out.append(f"{link}: {dest.name} has no heading with the anchor #{anchor}")
    return out
