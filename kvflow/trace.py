"""A Chrome / Perfetto trace of where a kvflow process spends its time (``KVFLOW_TRACE=path``).

With ``KVFLOW_TRACE`` set when kvflow is imported, each process writes the trace-event JSON
(the format ``chrome://tracing`` and https://ui.perfetto.dev load) of its kvflow work to a file
of its own: ``path`` with the process's role and pid put before the suffix, e.g.
``/tmp/kv.json`` -> ``/tmp/kv.worker-4242.json``. Roles: ``scheduler`` and ``worker`` (the vLLM
connector), ``pool`` (``kvflow serve``), else ``process``. The timestamps are the system's
monotonic clock in microseconds, the same in every process of the machine, so the files of one
run can be opened together.

Cost: off, every call site is one test of the module flag ``ENABLED``
(``if trace.ENABLED: ...``); nothing else runs. On, an event is a tuple appended to a ring
buffer of ``BUFFER_EVENTS`` (the oldest are dropped if the writer falls that far behind); a
writer thread appends the buffer to the file every ``FLUSH_S`` seconds, and ``stop()`` (also
run at exit) writes the rest and the closing ``]``; ``flush()`` writes what is buffered (the
vLLM connector calls it when vLLM shuts it down). A process killed before that leaves a file
without the ``]``, which both viewers accept (the format allows it).

Concurrency: every function may be called from any thread.
"""

from __future__ import annotations

import atexit
import collections
import json
import os
import threading
import time
from typing import Any

__all__ = [
    "BUFFER_EVENTS",
    "ENABLED",
    "FLUSH_S",
    "async_begin",
    "async_end",
    "complete",
    "flush",
    "instant",
    "now",
    "path_for",
    "set_role",
    "start",
    "stop",
]

ENV = "KVFLOW_TRACE"
BUFFER_EVENTS = 1 << 18  # events held between writes, at most
FLUSH_S = 1.0

ENABLED = False  # read once: every call site tests it before calling in

# one event: (phase, name, category, start ns, duration ns, thread id, id, args)
_Event = tuple[str, str, str, int, int, int, int, "dict[str, Any] | None"]
_buffer: collections.deque[_Event] = collections.deque(maxlen=BUFFER_EVENTS)
_lock = threading.Lock()  # the file and the writer's state
_state: dict[str, Any] = {}
_names: dict[int, str] = {}  # thread id -> its name


def now() -> int:
    """The trace clock, in nanoseconds (CLOCK_MONOTONIC: one clock for every process)."""
    return time.monotonic_ns()


def _tid() -> int:
    tid = threading.get_native_id()
    if tid not in _names:  # named while it runs: it may be gone when the events are written
        _names[tid] = threading.current_thread().name
    return tid


def complete(name: str, start_ns: int, cat: str = "kvflow", **args: Any) -> None:
    """A span of this thread from ``start_ns`` (``now()``) to now."""
    t = time.monotonic_ns()
    _buffer.append(("X", name, cat, start_ns, t - start_ns, _tid(), 0, args))


def instant(name: str, cat: str = "kvflow", **args: Any) -> None:
    """A moment on this thread."""
    _buffer.append(("i", name, cat, time.monotonic_ns(), 0, _tid(), 0, args))


def async_begin(name: str, ident: int, cat: str = "kvflow", **args: Any) -> None:
    """The start of a span that may overlap others (a step's load, its save): shown on a
    track of its own, ended by ``async_end`` with the same name, category and ``ident``."""
    _buffer.append(("b", name, cat, time.monotonic_ns(), 0, _tid(), ident, args))


def async_end(name: str, ident: int, cat: str = "kvflow", **args: Any) -> None:
    _buffer.append(("e", name, cat, time.monotonic_ns(), 0, _tid(), ident, args))


def set_role(role: str) -> None:
    """Name this process in the trace (``scheduler``, ``worker``, ``pool``). The file is named
    after the first role set before it is opened; every role is listed in the process's name."""
    roles: list[str] = _state.setdefault("roles", [])
    if role not in roles:
        roles.append(role)


def path_for(path: str, role: str, pid: int) -> str:
    """``/tmp/kv.json`` -> ``/tmp/kv.<role>-<pid>.json`` (``.json`` added when missing)."""
    stem, ext = os.path.splitext(path)
    if ext != ".json":
        stem, ext = path, ".json"
    return f"{stem}.{role}-{pid}{ext}"


def start(path: str) -> None:
    """Trace this process into ``path`` (with role and pid added); what ``KVFLOW_TRACE`` does
    at import. A second call while tracing changes nothing."""
    global ENABLED
    with _lock:
        if ENABLED:
            return
        _state.update(path=path, file=None, pid=os.getpid(), written=0)
        _buffer.clear()
        _names.clear()
        stopping = threading.Event()
        _state["stopping"] = stopping
        writer = threading.Thread(target=_write_loop, args=(stopping,), name="kvflow-trace")
        writer.daemon = True
        _state["writer"] = writer
        ENABLED = True
    writer.start()


def stop() -> str | None:
    """Stop tracing: write what is buffered and close the file (valid JSON from then on).
    Returns the file's path, or None if nothing was traced."""
    global ENABLED
    with _lock:
        if not ENABLED:
            return None
        ENABLED = False
        _state["stopping"].set()
    writer: threading.Thread = _state["writer"]
    if writer is not threading.current_thread():
        writer.join(10.0)
    with _lock:
        _flush()
        f = _state.get("file")
        if f is None:
            return None
        f.write("\n]\n")
        f.close()
        _state["file"] = None
        return str(f.name)


def flush() -> None:
    """Write what is buffered now (the file stays open): for a component that is shutting
    down in a process that may be killed rather than exit."""
    with _lock:
        if ENABLED:
            _flush()


def _write_loop(stopping: threading.Event) -> None:
    while not stopping.wait(FLUSH_S):
        with _lock:
            _flush()


def _flush() -> None:
    """Append the buffered events to the file (opened on the first). Holds _lock."""
    if not _buffer:
        return
    f = _state.get("file")
    pid = _state["pid"]
    if f is None:
        roles = _state.get("roles") or ["process"]
        f = _state["file"] = open(path_for(_state["path"], roles[0], pid), "w")  # noqa: SIM115
        f.write("[\n")
        f.write(_meta("process_name", pid, 0, name=f"kvflow {'+'.join(roles)} ({pid})"))
        _state["threads"] = set()
    threads: set[int] = _state["threads"]
    out = []
    while _buffer:
        ph, name, cat, ts, dur, tid, ident, args = _buffer.popleft()
        if tid not in threads:
            threads.add(tid)
            out.append(",\n" + _meta("thread_name", pid, tid, name=_names.get(tid, str(tid))))
        event: dict[str, Any] = {"name": name, "cat": cat, "ph": ph, "ts": ts / 1e3}
        event.update(pid=pid, tid=tid)
        if ph == "X":
            event["dur"] = dur / 1e3
        elif ph == "i":
            event["s"] = "t"
        elif ident:
            event["id"] = ident
        if args:
            event["args"] = args
        out.append(",\n" + json.dumps(event, default=str))
    f.write("".join(out))
    f.flush()


def _meta(kind: str, pid: int, tid: int, **args: Any) -> str:
    event = {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}
    return json.dumps(event)


def _after_fork() -> None:
    """A forked child traces into a file of its own, not its parent's."""
    global ENABLED, _lock
    _lock = threading.Lock()  # another thread of the parent may have held it
    if ENABLED:
        ENABLED = False
        path = _state["path"]
        _state["file"] = None  # the parent's file object: not ours to write or close
        start(path)


os.register_at_fork(after_in_child=_after_fork)
atexit.register(stop)
if os.environ.get(ENV):
    start(os.environ[ENV])
