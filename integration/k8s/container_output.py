"""What a simulated container prints, and its log as the simulated kubelet keeps and serves it.

The node simulator (integration/k8s/simulator.py) decides a container's fate from the Pod's
annotations (``sim.gpush.io/duration``, ``exit-code``, ``oom``), never from its command. Its output
comes from the command, read the way the container would run it, as far as that can be told
without running anything:

- Kubernetes' own ``$(VAR)`` references in ``command`` and ``args`` are expanded from the
  container's ``env`` (``$$`` escapes), as the kubelet does; ``HOSTNAME`` is the Pod's host name
  (``spec.hostname``, else its name). A variable ``valueFrom`` a ``fieldRef`` reads the Pod's
  field as the kubelet's downward API does (``metadata.annotations['KEY']``, ``metadata.labels['KEY']``,
  ``metadata.name``, ``metadata.namespace``, ``spec.nodeName``, ...); other sources are unknown.
- ``echo ...`` prints its arguments (``-n``: no newline).
- ``sh -c SCRIPT`` (bash, dash, ash; flags such as ``-ec``) runs a simple script: commands separated
  by ``;``, ``&&``, ``||``, ``&`` or newlines; ``echo`` prints, with ``$VAR``/``${VAR}`` expanded in
  unquoted and double-quoted words and ``>&2`` sending it to stderr (any other redirection, or a
  pipe, sends it away from the log); ``sleep N`` makes later lines come N seconds later; ``exit``
  ends the output; ``NAME=value`` and ``export`` set variables. Control flow (``if``, ``for``,
  ``while``, ``case``, functions, subshells) and command substitution end the interpretation:
  what such a script prints cannot be told, so nothing more is printed.
- ``python -c CODE`` runs top-level ``print(...)`` calls of literal values (``file=sys.stderr``
  included) and ``time.sleep(N)``; imports are skipped; any other statement ends the output.
- Any other program (``python train.py``) prints nothing: what it would print is unknown.

A line is printed at its time after the container started (divided by the simulator's speed)
and only if the container is still running then: a container that ends (its planned duration,
an OOM kill, a deletion) before ``sleep 60; echo done`` reaches the echo never prints it. So the
output always agrees with the fate the annotations gave.

Memory stays bounded: a container's lines come from its command, which the API server bounds,
and at most :data:`MAX_OUTPUT_BYTES` of them are kept per container run (the oldest dropped, as the
kubelet's log rotation does); a run's log lives in the kubelet's record of the Pod and goes when
the Pod does, and of earlier runs only the last is kept (``previous=true``).
"""

from __future__ import annotations

import ast
import bisect
import datetime
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

MAX_OUTPUT_BYTES = 1 << 20  # per container run; the kubelet's default rotation is at 10 MiB
STDOUT, STDERR = "stdout", "stderr"

_SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh", "busybox"})
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?\Z")
_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)\Z", re.S)
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)([smhd]?)\Z")
_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_CONTROL = frozenset(
    {"if", "then", "else", "elif", "fi", "for", "while", "until", "do", "done", "case", "esac", "function", "{", "}"}
)
_SEPARATORS = frozenset({";", "&&", "||", "&", "\n"})
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclass(frozen=True)
class Line:
    """One line a program prints: ``at`` seconds (simulated) after it started, on ``stream``."""

    at: float
    stream: str
    text: str  # with its newline, unless the program ended without one


class _Unpredictable(Exception):
    """The rest of the program's output cannot be told without running it."""


class _Exit(Exception):
    """The program ends here."""


# -- what a command prints ---------------------------------------------------------------------


def expand_references(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion of command and args: defined names are replaced, ``$$``
    is a literal ``$``, anything else stays as written."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _REFERENCE.sub(one, text)


_FIELD_MAP = re.compile(r"^metadata\.(annotations|labels)\['([^']+)'\]\Z")


def pod_field(pod: Mapping, path: str) -> str | None:
    """A downward API ``fieldRef``'s value in ``pod``, or None when the simulator cannot tell it."""
    mapped = _FIELD_MAP.match(path)
    metadata = pod.get("metadata") or {}
    if mapped:
        value = (metadata.get(mapped.group(1)) or {}).get(mapped.group(2))
        return value if isinstance(value, str) else ""  # the kubelet gives "" for a missing key
    parts = path.split(".")
    if len(parts) != 2 or parts[0] not in ("metadata", "spec", "status"):
        return None
    value = (pod.get(parts[0]) or {}).get(parts[1])
    return str(value) if isinstance(value, (str, int)) else None


def container_env(container: Mapping, pod_name: str, pod: Mapping | None = None) -> dict[str, str]:
    """The variables a container sees that the simulator can know: its literal ``env`` values,
    those from a ``fieldRef`` of ``pod`` (others of ``valueFrom`` cannot be resolved here), and
    ``HOSTNAME``, the Pod's host name."""
    hostname = ((pod or {}).get("spec") or {}).get("hostname") or pod_name
    env = {"HOSTNAME": hostname, "HOME": "/root", "PATH": _PATH}
    for var in container.get("env") or ():
        if not isinstance(var, Mapping) or not isinstance(var.get("name"), str):
            continue
        if isinstance(var.get("value"), str):
            env[var["name"]] = expand_references(var["value"], env)
        elif pod is not None and (path := ((var.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath")):
            value = pod_field(pod, str(path))
            if value is not None:
                env[var["name"]] = value
    return env


def program_output(container: Mapping, pod_name: str, pod: Mapping | None = None) -> list[Line]:
    """What ``container`` prints when it runs in Pod ``pod_name`` (``pod``: the Pod, whose fields
    its ``fieldRef`` variables read; see the module docstring)."""
    command = [str(a) for a in container.get("command") or ()]
    if not command:
        return []  # the image's entrypoint runs: what it prints is unknown
    env = container_env(container, pod_name, pod)
    argv = [expand_references(a, env) for a in [*command, *(str(a) for a in container.get("args") or ())]]
    out = _Output()
    try:
        _run(argv, env, out)
    except (_Unpredictable, _Exit):
        pass
    return out.lines()


class _Output:
    """Lines as a program writes them, with the simulated time it has spent; bounded."""

    def __init__(self) -> None:
        self.now = 0.0
        self._lines: list[Line] = []
        self._partial: dict[str, str] = {}
        self._size = 0

    def write(self, stream: str, text: str) -> None:
        pending = self._partial.pop(stream, "") + text
        while True:
            end = pending.find("\n")
            if end < 0:
                break
            self._add(Line(self.now, stream, pending[: end + 1]))
            pending = pending[end + 1 :]
        if pending:
            self._partial[stream] = pending
        if self._size > MAX_OUTPUT_BYTES:
            raise _Exit  # a single command this long is not worth simulating further

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.0)

    def _add(self, line: Line) -> None:
        self._lines.append(line)
        self._size += len(line.text.encode())

    def lines(self) -> list[Line]:
        for stream, text in self._partial.items():  # what was printed without a final newline
            self._add(Line(self.now, stream, text))
        self._partial.clear()
        lines, size = self._lines, self._size
        start = 0
        while size > MAX_OUTPUT_BYTES and start < len(lines):
            size -= len(lines[start].text.encode())
            start += 1
        return lines[start:]


def _run(argv: Sequence[str], env: Mapping[str, str], out: _Output, stream: str = STDOUT) -> None:
    if not argv:
        return
    program = os.path.basename(argv[0])
    if program == "busybox" and len(argv) > 1:
        _run(argv[1:], env, out, stream)
    elif program == "echo":
        _echo(argv[1:], out, stream)
    elif program in _SHELLS:
        script = _shell_script(argv[1:])
        if script is not None:
            _Shell(dict(env), out).run(script)
    elif _PYTHON.match(program):
        code = _python_code(argv[1:])
        if code is not None:
            _python(code, out)
    elif program == "sleep" and len(argv) > 1:
        out.sleep(_sleep_seconds(argv[1]))


def _echo(args: Sequence[str], out: _Output, stream: str) -> None:
    newline = True
    args = list(args)
    while args and args[0] in ("-n", "-e", "-E", "-ne", "-en"):
        newline = newline and "n" not in args.pop(0)
    out.write(stream, " ".join(args) + ("\n" if newline else ""))


def _sleep_seconds(text: str) -> float:
    match = _DURATION.match(text.strip())
    if match is None:
        raise _Unpredictable  # sleep infinity, $(...): nothing after it is printed in time
    return float(match.group(1)) * _SECONDS[match.group(2)]


def _shell_script(args: Sequence[str]) -> str | None:
    """The script of ``sh [-flags] -c SCRIPT [...]``, or None when it is not given inline."""
    for i, arg in enumerate(args):
        if not arg.startswith("-") or arg == "-":
            return None
        if "c" in arg[1:]:
            return args[i + 1] if i + 1 < len(args) else None
    return None


def _python_code(args: Sequence[str]) -> str | None:
    for i, arg in enumerate(args):
        if arg == "-c":
            return args[i + 1] if i + 1 < len(args) else None
        if not arg.startswith("-"):
            return None  # a script file
    return None


# -- a small shell ------------------------------------------------------------------------------


@dataclass
class _Word:
    text: str
    quoted: bool = False


class _Shell:
    """Interprets the simple scripts of ``sh -c`` (see the module docstring)."""

    def __init__(self, env: dict[str, str], out: _Output) -> None:
        self.env = env
        self.out = out

    def run(self, script: str) -> None:
        command: list[_Word] = []
        redirects: list[tuple[str, str]] = []
        piped = False
        for kind, value in _tokens(script, self.env):
            if kind == "op" and value in _SEPARATORS:
                self._command(command, redirects, piped)
                command, redirects, piped = [], [], False
            elif kind == "op" and value == "|":
                piped = True  # only the pipeline's last command writes to the log: drop the first
                command, redirects = [], []
            elif kind == "op" and value == "(":
                raise _Unpredictable
            elif kind == "redirect":
                redirects.append(value)  # type: ignore[arg-type]
            elif kind == "word":
                if not command and not value.quoted and value.text in _CONTROL:  # type: ignore[union-attr]
                    raise _Unpredictable
                command.append(value)  # type: ignore[arg-type]
        self._command(command, redirects, piped)

    def _command(self, words: list[_Word], redirects: list[tuple[str, str]], piped: bool) -> None:
        args = [w.text for w in words]
        while args and (assignment := _ASSIGNMENT.match(args[0])):
            self.env[assignment.group(1)] = assignment.group(2)
            args = args[1:]
        if not args:
            return
        program = os.path.basename(args[0])
        if program == "exec":
            self._command([_Word(a) for a in args[1:]], redirects, piped)
            raise _Exit
        if program == "exit":
            raise _Exit
        if program == "export":
            for arg in args[1:]:
                match = _ASSIGNMENT.match(arg)
                if match:
                    self.env[match.group(1)] = match.group(2)
            return
        if program == "sleep" and len(args) > 1:
            self.out.sleep(_sleep_seconds(args[1]))
            return
        if program == "echo":
            stream = STDOUT
            for fd, target in redirects:
                if fd == "1":
                    stream = STDERR if target == "&2" else ("" if target != "&1" else stream)
            if piped or not stream:
                return
            _echo(args[1:], self.out, stream)
        elif program in _SHELLS or program == "busybox" or _PYTHON.match(program):
            if not piped and not redirects:
                _run(args, self.env, self.out)
        # any other program prints what cannot be known: nothing, at no cost in time


def _tokens(script: str, env: Mapping[str, str]) -> Iterator[tuple[str, object]]:
    """Words (expanded, with whether any part was quoted), operators and redirections
    (``(fd, target)``) of a script; command substitution raises :class:`_Unpredictable`."""
    i, n = 0, len(script)
    while i < n:
        c = script[i]
        if c in " \t":
            i += 1
        elif c == "\\" and script[i + 1 : i + 2] == "\n":
            i += 2
        elif c == "#":
            while i < n and script[i] != "\n":
                i += 1
        elif c == "\n":
            yield "op", "\n"
            i += 1
        elif script.startswith(("&&", "||"), i):
            yield "op", script[i : i + 2]
            i += 2
        elif c in ";&|()":
            if c == "&" and script.startswith("&>", i):
                target, i = _redirect_target(script, i + 2, env)
                yield "redirect", ("1", target)
                continue
            yield "op", c
            i += 1
        elif c in "<>" or (c.isdigit() and _redirect_at(script, i)):
            fd = "1" if c == ">" else ("0" if c == "<" else "")
            if c.isdigit():
                while script[i].isdigit():
                    fd += script[i]
                    i += 1
            i += 1  # the < or >
            if script[i : i + 1] in (">", "|"):
                i += 1
            if script[i : i + 1] == "&":
                start = i
                i += 1
                while i < n and (script[i].isdigit() or script[i] == "-"):
                    i += 1
                yield "redirect", (fd, script[start:i])
            else:
                target, i = _redirect_target(script, i, env)
                yield "redirect", (fd, target)
        else:
            word, i = _word(script, i, env)
            yield "word", word


def _redirect_at(script: str, i: int) -> bool:
    j = i
    while j < len(script) and script[j].isdigit():
        j += 1
    return j < len(script) and script[j] in "<>" and (i == 0 or script[i - 1] in " \t;&|\n")


def _redirect_target(script: str, i: int, env: Mapping[str, str]) -> tuple[str, int]:
    while i < len(script) and script[i] in " \t":
        i += 1
    word, i = _word(script, i, env)
    return word.text, i


def _word(script: str, i: int, env: Mapping[str, str]) -> tuple[_Word, int]:
    parts: list[str] = []
    quoted = False
    n = len(script)
    while i < n and script[i] not in " \t\n;&|()<>":
        c = script[i]
        if c == "'":
            end = script.find("'", i + 1)
            if end < 0:
                raise _Unpredictable  # unterminated: sh refuses the script
            parts.append(script[i + 1 : end])
            quoted, i = True, end + 1
        elif c == '"':
            i += 1
            while i < n and script[i] != '"':
                if script[i] == "\\" and i + 1 < n and script[i + 1] in '"\\$`\n':
                    parts.append("" if script[i + 1] == "\n" else script[i + 1])
                    i += 2
                elif script[i] == "$":
                    text, i = _expansion(script, i, env)
                    parts.append(text)
                elif script[i] == "`":
                    raise _Unpredictable
                else:
                    parts.append(script[i])
                    i += 1
            if i >= n:
                raise _Unpredictable
            quoted, i = True, i + 1
        elif c == "\\":
            parts.append(script[i + 1 : i + 2])
            i += 2
        elif c == "$":
            text, i = _expansion(script, i, env)
            parts.append(text)
        elif c == "`":
            raise _Unpredictable
        else:
            parts.append(c)
            i += 1
    return _Word("".join(parts), quoted), i


def _expansion(script: str, i: int, env: Mapping[str, str]) -> tuple[str, int]:
    """``$NAME``, ``${NAME}``, ``$?`` and friends at ``script[i]``; ``$(...)`` is unpredictable."""
    rest = script[i + 1 :]
    if rest.startswith("("):
        raise _Unpredictable
    if rest.startswith("{"):
        end = rest.find("}")
        name = rest[1:end] if end > 0 else ""
        if not _NAME.fullmatch(name):
            raise _Unpredictable  # ${X:-default} and other operators: not simulated
        return env.get(name, ""), i + end + 2
    match = _NAME.match(rest)
    if match:
        return env.get(match.group(0), ""), i + 1 + match.end()
    if rest[:1] == "?" or rest[:1] == "#":
        return "0", i + 2
    if rest[:1] == "$":
        return "1", i + 2  # the container's main process is pid 1
    if rest[:1].isdigit():
        return "", i + 2
    return "$", i + 1


# -- python -c -------------------------------------------------------------------------------------


def _python(code: str, out: _Output) -> None:
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return  # python prints its SyntaxError to stderr; the simulator does not mimic tracebacks
    for statement in tree.body:
        if isinstance(statement, ast.Import | ast.ImportFrom | ast.Pass):
            continue
        call = statement.value if isinstance(statement, ast.Expr) else None
        if not isinstance(call, ast.Call):
            raise _Unpredictable
        name = _call_name(call.func)
        if name == "print":
            _python_print(call, out)
        elif name in ("time.sleep", "sleep") and len(call.args) == 1:
            value = _literal(call.args[0])
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise _Unpredictable
            out.sleep(float(value))
        elif name in ("sys.exit", "exit", "quit", "os._exit"):
            raise _Exit
        else:
            raise _Unpredictable


def _call_name(func: ast.expr) -> str:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f"{func.value.id}.{func.attr}"
    return ""


def _literal(node: ast.expr) -> object:
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        raise _Unpredictable from None


def _python_print(call: ast.Call, out: _Output) -> None:
    if any(isinstance(a, ast.Starred) for a in call.args):
        raise _Unpredictable
    values = [_literal(a) for a in call.args]
    sep, end, stream = " ", "\n", STDOUT
    for keyword in call.keywords:
        if keyword.arg == "file":
            target = _call_name(keyword.value)
            if target not in ("sys.stderr", "sys.stdout"):
                raise _Unpredictable
            stream = STDERR if target == "sys.stderr" else STDOUT
        elif keyword.arg in ("sep", "end"):
            value = _literal(keyword.value)
            if value is None:  # print's own default
                value = " " if keyword.arg == "sep" else "\n"
            if not isinstance(value, str):
                raise _Unpredictable
            sep, end = (value, end) if keyword.arg == "sep" else (sep, value)
        elif keyword.arg != "flush":
            raise _Unpredictable
    out.write(stream, sep.join(str(v) for v in values) + end)


# -- one container run's log -------------------------------------------------------------------


def rfc3339_nano(when: float) -> str:
    """The kubelet's timestamp of a log line (``timestamps=true``): nanoseconds, UTC, fixed width."""
    moment = datetime.datetime.fromtimestamp(when, datetime.UTC)
    nanos = int(round((when - int(when)) * 1e9)) % 1_000_000_000
    return moment.strftime("%Y-%m-%dT%H:%M:%S") + f".{nanos:09d}Z"


class ContainerLog:
    """The log of one run of one container: its lines, when it started and when it ended.

    ``started`` and ``ended`` are wall-clock seconds (``time.time()``); a line is in the log once
    ``started + at / speed`` has passed, provided that is not after ``ended``. Thread-safe: the
    kubelet ends it while the log server reads it.
    """

    def __init__(self, lines: Sequence[Line], *, started: float | None = None, speed: float = 1.0) -> None:
        self.started = time.time() if started is None else started
        self.lines = tuple(lines)
        self._due = [self.started + line.at / speed for line in self.lines]
        self.ended: float | None = None
        self._done = threading.Event()

    def end(self, when: float | None = None) -> None:
        """The container stopped (exited, was killed, or its Pod went): no more lines."""
        if self.ended is None:
            self.ended = time.time() if when is None else when
        self._done.set()

    @property
    def running(self) -> bool:
        return self.ended is None

    def printed(self, now: float | None = None) -> int:
        """How many lines are in the log at ``now``."""
        now = time.time() if now is None else now
        if self.ended is not None:
            now = min(now, self.ended)
        return bisect.bisect_right(self._due, now)

    def due(self, index: int) -> float:
        """When line ``index`` is printed (wall clock); infinity past the last line."""
        return self._due[index] if index < len(self._due) else float("inf")

    def complete(self, index: int) -> bool:
        """Whether a reader that has ``index`` lines has all the container will ever print."""
        return self.ended is not None and index >= self.printed(self.ended)

    def wait(self, until: float) -> None:
        """Sleep until ``until`` (wall clock) or the container's end, whichever is first."""
        self._done.wait(max(until - time.time(), 0.0))

    def first_since(self, since: float) -> int:
        """The index of the first line printed at or after ``since``."""
        return bisect.bisect_left(self._due, since)

    def render(self, index: int, *, timestamps: bool) -> bytes:
        text = self.lines[index].text.encode()
        if timestamps:
            return rfc3339_nano(self._due[index]).encode() + b" " + text
        return text
