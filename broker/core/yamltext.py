"""YAML that people write (policies, job files, fleet and workload files, cluster
configs): the one loader gpush reads it with, parsed or refused at the line and column.

Every YAML gpush reads goes through :class:`BoundedLoader` (libyaml's safe loader),
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

import gc
import reprlib
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import yaml

try:
    from yaml import CSafeLoader
    from yaml._yaml import CParser
except ImportError:  # PyYAML built without libyaml
    CSafeLoader = CParser = None

from broker.core.errors import InvalidRequest

MAX_DEPTH = 64
MAX_ALIASES = 10_000
MAX_ALIAS_NODES = 100_000
MAX_INT_CHARS = 64
_LIBYAML_TOO_DEEP = "exceeded maximum nesting depth"
# The most of one value (a string, a repr) an error message shows, before an ellipsis.
EXCERPT_CHARS = 200

_WHAT_TO_DO = "write the values out, or split the file"


class YamlLimitExceeded(yaml.MarkedYAMLError):
    """A document over one of this module's limits; ``problem`` names the limit and what to do."""


def check_limits(events: Iterable[yaml.Event]) -> None:
    """Refuse a stream of parser events over the limits: nesting deeper than
    ``MAX_DEPTH``, more than ``MAX_ALIASES`` aliases, more than ``MAX_ALIAS_NODES`` nodes
    reached through them, or an alias inside what it names (a cycle).

    It reads the events once, keeping only a stack of open collections and the expanded
    size of each anchor, so it costs a fraction of building the document and nothing is
    built when it refuses."""
    aliases = 0
    nodes = 0  # every node so far, an alias counting as all it names
    alias_nodes = 0
    sizes: dict[str, int] = {}  # anchor -> expanded size of its finished node
    open_: list[tuple[int, str | None]] = []  # (nodes before it, anchor) per open collection
    for event in events:
        kind = type(event)
        if kind is yaml.ScalarEvent:
            nodes += 1
            if event.anchor is not None:
                sizes[event.anchor] = 1
        elif kind is yaml.MappingStartEvent or kind is yaml.SequenceStartEvent:
            if len(open_) >= MAX_DEPTH:
                _refuse(_too_deep(), event.start_mark)
            open_.append((nodes, event.anchor))
            if event.anchor is not None:
                sizes.pop(event.anchor, None)  # an alias to it now is inside it
            nodes += 1
        elif kind is yaml.MappingEndEvent or kind is yaml.SequenceEndEvent:
            before, anchor = open_.pop()
            if anchor is not None:
                sizes[anchor] = nodes - before
        elif kind is yaml.AliasEvent:
            aliases += 1
            if aliases > MAX_ALIASES:
                _refuse(f"more than {MAX_ALIASES:,} aliases (*name); {_WHAT_TO_DO}", event.start_mark)
            size = sizes.get(event.anchor)
            if size is None:
                if any(anchor == event.anchor for _, anchor in open_):
                    _refuse(
                        f"alias *{excerpt(event.anchor, 64, quote=False)} is inside the node it names "
                        "(a cycle): write the value out instead",
                        event.start_mark,
                    )
                continue  # an undefined alias: composing says so, with its place
            nodes += size
            alias_nodes += size
            if alias_nodes > MAX_ALIAS_NODES:
                _refuse(
                    f"aliases (*name) here expand to more than {MAX_ALIAS_NODES:,} nodes; {_WHAT_TO_DO}",
                    event.start_mark,
                )
        elif kind is yaml.DocumentEndEvent:
            sizes.clear()  # anchors belong to their document


def _refuse(problem: str, mark: yaml.Mark | None) -> None:
    raise YamlLimitExceeded(problem=problem, problem_mark=mark)


class _IntLimit:
    """An integer written with more than ``MAX_INT_CHARS`` characters is refused."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        # Python refuses to read an integer of more than 4,300 decimal digits with a
        # ValueError, which no YAML error handler catches; a hexadecimal one it reads,
        # into a number that no message can print. No field gpush reads needs either.
        if len(node.value) > MAX_INT_CHARS:
            _refuse(
                f"a number of more than {MAX_INT_CHARS} characters: no gpush field takes one that large",
                node.start_mark,
            )
        return super().construct_yaml_int(node)  # type: ignore[misc]


class _PyEvents(yaml.SafeLoader):
    """PyYAML's pure-Python parser, refusing deep brackets while it scans."""

    def fetch_flow_collection_start(self, TokenClass: type[yaml.Token]) -> None:
        # The scanner looks up to 1,024 characters ahead at every open bracket for a
        # possible key: thousands of brackets cost a fifth of a second before the events
        # ever show the depth, so refuse them here already.
        if self.flow_level >= MAX_DEPTH:
            _refuse(_too_deep(), self.get_mark())
        super().fetch_flow_collection_start(TokenClass)


def _events(parser: Any) -> Iterator[yaml.Event]:
    try:
        while parser.check_event():
            yield parser.get_event()
    finally:
        parser.dispose()


class PyBoundedLoader(_IntLimit, yaml.SafeLoader):
    """``yaml.SafeLoader`` (PyYAML's Python) over a document that :func:`check_limits` has
    passed: what :data:`BoundedLoader` is where PyYAML was built without libyaml."""

    def __init__(self, stream: Any) -> None:
        check_limits(_events(_PyEvents(stream)))
        super().__init__(stream)


PyBoundedLoader.add_constructor("tag:yaml.org,2002:int", PyBoundedLoader.construct_yaml_int)

if CSafeLoader is not None:

    class CBoundedLoader(_IntLimit, CSafeLoader):  # type: ignore[misc]
        """``yaml.CSafeLoader`` (libyaml's parser and composer) over a document that
        :func:`check_limits` has passed. The events are read twice, once to count and once
        to build; both in C, that is still five times quicker than PyYAML's Python loader,
        whose scanner took nine tenths of the time of a 10,000-rule policy."""

        def __init__(self, stream: Any) -> None:
            if isinstance(stream, str):
                _refuse_unencodable(stream)
            check_limits(_events(CParser(stream)))
            super().__init__(stream)

    CBoundedLoader.add_constructor("tag:yaml.org,2002:int", CBoundedLoader.construct_yaml_int)

#: The loader every YAML gpush reads goes through: libyaml's where PyYAML has it.
BoundedLoader: type[yaml.SafeLoader] = CBoundedLoader if CSafeLoader is not None else PyBoundedLoader


def _refuse_unencodable(text: str) -> None:
    # libyaml reads UTF-8: a lone surrogate (which JSON can carry into a str) would fail
    # in the encoder without a line or column. Refuse it as PyYAML's reader does.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise yaml.reader.ReaderError(
            "<text>", exc.start, ord(text[exc.start]), "unicode", "special characters are not allowed"
        ) from None


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
    if problem.startswith(_LIBYAML_TOO_DEEP):
        # libyaml's scanner reads a run of open brackets ahead of the events and stops at
        # its own limit (1,000 levels) before composing counts the 65th: the same refusal.
        return _too_deep(), line, column
    if not isinstance(exc, YamlLimitExceeded):
        problem = f"not valid YAML: {problem}"
    return problem, line, column


_gc_lock = threading.Lock()
_gc_pausers = 0
_gc_was_enabled = True


@contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while a document is built, back on after.

    Reading YAML makes hundreds of thousands of small objects (events, nodes, values) and
    frees none until the end, so the collector runs again and again over an ever larger
    heap: two thirds of the time of a 10,000-rule policy (5.2 s with it, 1.7 s without).
    Nothing a loader builds is a reference cycle, and the input is bounded in size before
    it gets here, so the pause keeps no memory that reference counting would not free.
    The collector is process-wide: the last thread in here turns it back on, and only if
    it was on when the first came in."""
    global _gc_pausers, _gc_was_enabled
    with _gc_lock:
        if _gc_pausers == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_pausers += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pausers -= 1
            if _gc_pausers == 0 and _gc_was_enabled:
                gc.enable()


def load_yaml(text: str, *, source: str, all_documents: bool = False) -> Any:
    """The document (or, with ``all_documents``, the list of non-empty documents) of
    ``text``, read with :class:`BoundedLoader`; :class:`InvalidRequest` naming ``source``,
    the line and column, and what to do otherwise."""
    with gc_paused():
        return _load_yaml(text, source, all_documents)


def _load_yaml(text: str, source: str, all_documents: bool) -> Any:
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
