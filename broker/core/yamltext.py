"""YAML that people write (policies, job files, fleet and workload files, cluster
configs): the one loader gpush reads it with, parsed or refused at the line and column.

Every YAML gpush reads goes through :class:`BoundedLoader` (a ``yaml.SafeLoader``),
because YAML lets a few hundred bytes stand for billions of nodes: aliases that name
anchors that hold aliases ("billion laughs"). PyYAML builds such a document cheaply,
sharing one object per anchor, but whatever walks it afterwards (validation, error
messages, storing it) expands every alias, and a 420-byte policy grew the broker by
2.3 GB. Deep nesting is refused too, since composing and constructing recurse once per
level and 5,000 levels end in a RecursionError. The limits, per stream (every document
of a file together):

- ``MAX_DEPTH`` (64) levels of nesting. A policy, job file, fleet or workload nests at
  most 6 deep; 64 keeps composing and constructing (about 3 Python frames a level) far
  from Python's recursion limit of 1,000, and every later walk cheap.
- ``MAX_ALIASES`` (10,000) aliases (``*name``). Real files use a few, to share a route
  or a set of fallbacks; 10,000 lets every rule of a policy of a few thousand rules
  use two or three.
- ``MAX_ALIAS_NODES`` (100,000) nodes reached through aliases, counting each alias as
  the whole of what it names (a list of 9 aliases to a list of 9 counts 9 x 10). Nodes
  written out in the text are not counted here: the size of the text bounds them. A
  few thousand rules each sharing fallbacks of a few routes come to some 50,000; the
  billion laughs passes 100,000 at its sixth level and is refused before anything is
  built.

An alias inside the node it names (a cycle) is refused as well: nothing gpush reads is
recursive, and walking one never ends. So is an integer written with more than
``MAX_INT_CHARS`` (64) characters, which Python cannot read or print (over 4,300 digits).

A refusal is :class:`YamlLimitExceeded`, a ``yaml.MarkedYAMLError``, so callers that
already turn YAML errors into messages with a line and column (load_yaml here,
broker.routing.rules' load_policy) report it the same way. Messages never echo more of
the input than :func:`excerpt` allows (``EXCERPT_CHARS``).
"""

from __future__ import annotations

import reprlib
from typing import Any

import yaml

from broker.core.errors import InvalidRequest

MAX_DEPTH = 64
MAX_ALIASES = 10_000
MAX_ALIAS_NODES = 100_000
MAX_INT_CHARS = 64
# The most of one value (a string, a repr) an error message shows, before an ellipsis.
EXCERPT_CHARS = 200

_WHAT_TO_DO = "write the values out, or split the file"


class YamlLimitExceeded(yaml.MarkedYAMLError):
    """A document over one of this module's limits; ``problem`` names the limit and what to do."""


class BoundedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses, while composing and before anything is built,
    nesting deeper than ``MAX_DEPTH``, more than ``MAX_ALIASES`` aliases, more than
    ``MAX_ALIAS_NODES`` nodes reached through them, and an alias inside what it names."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._depth = 0
        self._aliases = 0
        self._nodes = 0  # every node composed so far, an alias counting as all it names
        self._alias_nodes = 0
        # Expanded size of each finished node; a node named by an anchor but not yet in
        # here is still being composed, so an alias to it is a cycle.
        self._sizes: dict[yaml.Node, int] = {}

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                self._refuse(f"more than {MAX_ALIASES:,} aliases (*name); {_WHAT_TO_DO}", event.start_mark)
            target = self.anchors.get(event.anchor)
            if target is not None:
                size = self._sizes.get(target)
                if size is None:
                    self._refuse(
                        f"alias *{excerpt(event.anchor, 64, quote=False)} is inside the node it names "
                        "(a cycle): write the value out instead",
                        event.start_mark,
                    )
                self._nodes += size
                self._alias_nodes += size
                if self._alias_nodes > MAX_ALIAS_NODES:
                    self._refuse(
                        f"aliases (*name) here expand to more than {MAX_ALIAS_NODES:,} nodes; {_WHAT_TO_DO}",
                        event.start_mark,
                    )
            return super().compose_node(parent, index)
        if self._depth >= MAX_DEPTH:
            self._refuse(_too_deep(), self.peek_event().start_mark)
        before = self._nodes
        self._depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        self._nodes += 1
        self._sizes[node] = self._nodes - before
        return node

    def fetch_flow_collection_start(self, TokenClass: type[yaml.Token]) -> None:
        # The scanner looks up to 1,024 characters ahead at every open bracket for a
        # possible key: thousands of brackets cost a fifth of a second before composing
        # ever sees the depth, so refuse them here already.
        if self.flow_level >= MAX_DEPTH:
            self._refuse(_too_deep(), self.get_mark())
        super().fetch_flow_collection_start(TokenClass)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        # Python refuses to read an integer of more than 4,300 decimal digits with a
        # ValueError, which no YAML error handler catches; a hexadecimal one it reads,
        # into a number that no message can print. No field gpush reads needs either.
        if len(node.value) > MAX_INT_CHARS:
            self._refuse(
                f"a number of more than {MAX_INT_CHARS} characters: no gpush field takes one that large",
                node.start_mark,
            )
        return super().construct_yaml_int(node)

    @staticmethod
    def _refuse(problem: str, mark: yaml.Mark | None) -> None:
        raise YamlLimitExceeded(problem=problem, problem_mark=mark)


BoundedLoader.add_constructor("tag:yaml.org,2002:int", BoundedLoader.construct_yaml_int)


def _too_deep() -> str:
    return (
        f"nested more than {MAX_DEPTH} levels deep: flatten the document "
        "(no policy, job, fleet or workload file needs more than a few levels)"
    )


def excerpt(value: Any, limit: int = EXCERPT_CHARS, *, quote: bool = True) -> str:
    """``value`` for an error message: its repr (with ``quote``; else ``str`` of a
    string), at most ``limit`` characters, with an ellipsis where it was cut. Bounded in
    work as well as length: a nested value is walked only a few levels and items deep."""
    if isinstance(value, str) and not quote:
        text = value[: limit + 1]
    else:
        try:
            text = _short_repr.repr(value)
        except ValueError:  # an integer too long for Python to print
            text = f"<a {type(value).__name__} too large to show>"
    return text if len(text) <= limit else text[: limit - 1] + "…"


_short_repr = reprlib.Repr()
_short_repr.maxstring = _short_repr.maxother = EXCERPT_CHARS + 2
_short_repr.maxlevel = 3


def yaml_problem(exc: yaml.YAMLError) -> tuple[str, int | None, int | None]:
    """What a YAML error says, bounded, and its line and column (1-based) when known."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        problem = exc.problem or exc.context or "not valid YAML"
        line, column = (mark.line + 1, mark.column + 1) if mark else (None, None)
    else:
        problem, line, column = str(exc), None, None
    problem = excerpt(problem, 2 * EXCERPT_CHARS, quote=False)
    if not isinstance(exc, YamlLimitExceeded):
        problem = f"not valid YAML: {problem}"
    return problem, line, column


def load_yaml(text: str, *, source: str, all_documents: bool = False) -> Any:
    """The document (or, with ``all_documents``, the list of non-empty documents) of
    ``text``, read with :class:`BoundedLoader`; :class:`InvalidRequest` naming ``source``,
    the line and column, and what to do otherwise."""
    try:
        loader = BoundedLoader(text)  # reading starts here: a control character is refused at once
    except yaml.YAMLError as exc:
        problem, line, column = yaml_problem(exc)
        where = f"{source}, line {line}, column {column}" if line is not None else source
        raise InvalidRequest(f"{where}: {problem}") from None
    try:
        if all_documents:
            docs = []
            while loader.check_data():
                doc = loader.get_data()
                if doc is not None:
                    docs.append(doc)
            return docs
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        problem, line, column = yaml_problem(exc)
        where = f"{source}, line {line}, column {column}" if line is not None else source
        raise InvalidRequest(f"{where}: {problem}") from None
    finally:
        loader.dispose()
