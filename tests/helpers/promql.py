"""What a Grafana dashboard's PromQL asks Prometheus for: metric names, label names, legend labels.

Not a PromQL parser: a tokenizer that knows the few shapes a dashboard uses (selectors with
matchers, range brackets, functions, aggregations with ``by``/``without``, vector matching with
``on``/``ignoring``/``group_left``/``group_right``, Grafana's ``$variables`` and
``label_values(...)``), enough to tell every metric name apart from the words around it. Its own
tests (``tests/packaging/test_grafana.py``) show it finds a misspelled name.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

# Prometheus attaches these to every scraped series; a series' own ``job`` or ``instance`` label is
# renamed ``exported_job`` / ``exported_instance`` unless the scrape sets ``honor_labels: true``
# (Prometheus docs, scrape_config: honor_labels, default false).
TARGET_LABELS = frozenset({"instance", "job"})

KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "atan2"})
LABEL_LISTS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_TOKEN = re.compile(
    r"(?P<number>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)"
    r"|(?P<var>\$\{?[A-Za-z_][A-Za-z0-9_]*\}?)"
    r"|(?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)"
    r"|(?P<string>\"\")"
    r"|(?P<punct>=~|!~|!=|==|>=|<=|[(){}\[\],=<>+\-*/%^])"
    r"|(?P<space>\s+)"
)
_LABEL_VALUES = re.compile(r"^\s*label_values\((?P<expr>.*),\s*(?P<label>[A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$", re.S)
_LEGEND = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


@dataclass
class Query:
    """What one expression asks for."""

    metrics: list[str] = field(default_factory=list)
    matched: set[str] = field(default_factory=set)  # label names inside {...}
    grouped: set[str] = field(default_factory=set)  # label names in by/without/on/ignoring/group_*(...)


def _tokens(expr: str) -> list[tuple[str, str]]:
    text = _STRING.sub('""', expr)
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None:
            raise ValueError(f"cannot read {expr!r} at {text[pos:]!r}")
        kind = match.lastgroup or ""
        if kind != "space":
            out.append((kind, match.group()))
        pos = match.end()
    return out


def parse(expr: str) -> Query:
    """The metric names, matched labels and grouping labels of one PromQL expression.

    Raises ``ValueError`` for characters PromQL does not have or an unclosed bracket.
    """
    tokens = _tokens(expr)
    query = Query()
    i = 0

    def closing(start: int, opener: str, closer: str) -> int:
        depth = 0
        for j in range(start, len(tokens)):
            if tokens[j][1] == opener:
                depth += 1
            elif tokens[j][1] == closer:
                depth -= 1
                if depth == 0:
                    return j
        raise ValueError(f"unclosed {opener!r} in {expr!r}")

    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1][1] if i + 1 < len(tokens) else None
        if text == "[":  # a range or a subquery: durations and $__rate_interval, no names
            i = closing(i, "[", "]") + 1
        elif text == "{":  # matchers: label op string, ...
            end = closing(i, "{", "}")
            query.matched |= {t for k, t in tokens[i + 1 : end] if k == "ident"}
            i = end + 1
        elif kind == "ident" and text in LABEL_LISTS and following == "(":
            end = closing(i + 1, "(", ")")
            query.grouped |= {t for k, t in tokens[i + 2 : end] if k == "ident"}
            i = end + 1
        elif kind == "ident" and text == "offset":
            i += 3  # offset 5m: the number and its unit
        elif kind == "ident" and (following in ("(", "by", "without") or text in KEYWORDS):
            i += 1  # a function, an aggregation (sum by (...) (...)) or an operator word
        elif kind == "ident":
            query.metrics.append(text)
            i += 1
        else:
            i += 1
    return query


def legend_labels(legend: str) -> set[str]:
    """The labels a legend format names (``{{group}} on {{instance}}``)."""
    return set(_LEGEND.findall(legend))


def dashboard_queries(dashboard: Mapping[str, Any]) -> Iterator[tuple[str, str, str, str | None]]:
    """``(where, expr, legend, label)`` for every panel target and every ``label_values`` variable.

    ``label`` is the label a variable lists (None for a panel target); ``where`` names the panel
    or variable for messages.
    """

    def panels(items: list[Any]) -> Iterator[Any]:
        for panel in items:
            yield panel
            yield from panels(panel.get("panels", []))

    for panel in panels(dashboard.get("panels", [])):
        for target in panel.get("targets", []):
            where = f"panel {panel.get('title')!r} target {target.get('refId')}"
            yield where, str(target["expr"]), str(target.get("legendFormat", "")), None
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        raw = variable.get("query")
        text = str(raw.get("query", "")) if isinstance(raw, dict) else str(raw)
        match = _LABEL_VALUES.match(text)
        if match is None:
            raise ValueError(f"variable {variable.get('name')!r}: not a label_values(...) query: {text!r}")
        yield f"variable {variable.get('name')!r}", match["expr"], "", match["label"]


def as_scraped(labels: set[str]) -> set[str]:
    """A series' labels as Prometheus stores them: target labels added, clashing ones renamed ``exported_*``."""
    return {f"exported_{name}" if name in TARGET_LABELS else name for name in labels} | TARGET_LABELS


def problems(dashboard: Mapping[str, Any], exported: Mapping[str, set[str]], *, labels: bool = True) -> list[str]:
    """Every metric or label the dashboard names that ``exported`` (sample name -> label names) lacks.

    ``exported`` holds what a daemon serves, before Prometheus adds its target labels; with
    ``labels=False`` only metric names are checked. An empty list means every query can match.
    Raises ``ValueError`` for an expression it cannot read.
    """
    found: list[str] = []
    for where, expr, legend, listed in dashboard_queries(dashboard):
        query = parse(expr)
        if not query.metrics:
            found.append(f"{where}: names no metric: {expr!r}")
        known: set[str] = set()
        for name in query.metrics:
            if name not in exported:
                found.append(f"{where}: {name} is not a metric the daemon exports")
            else:
                known |= as_scraped(exported[name])
        if labels and all(name in exported for name in query.metrics):
            wanted = query.matched | query.grouped | legend_labels(legend) | ({listed} if listed else set())
            for label in sorted(wanted - known):
                found.append(f"{where}: label {label!r} is on none of {', '.join(query.metrics)}")
    return found


def used_metrics(dashboard: Mapping[str, Any]) -> set[str]:
    """Every metric name the dashboard's queries name."""
    return {name for _, expr, _, _ in dashboard_queries(dashboard) for name in parse(expr).metrics}
