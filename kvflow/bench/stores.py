"""The pools a benchmark can run on, each set up as a user would deploy it.

* ``local``: a LocalStore in the benchmark's process (prefaulted).
* ``shared``: a ``kvflow serve`` process of its own, in a fresh private directory, and a
  SharedStore connected to it (the arena mapped at connect).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from kvflow.errors import ConfigError
from kvflow.pool.launch import wait_until_serving
from kvflow.stores.base import Store
from kvflow.stores.local import LocalStore
from kvflow.stores.shared import SharedStore

__all__ = ["STORE_KINDS", "bench_store", "pool_server"]

STORE_KINDS = ("local", "shared")


@contextmanager
def pool_server(capacity: int) -> Iterator[str]:
    """A ``kvflow serve`` subprocess with ``capacity`` bytes; yields its socket path."""
    directory = tempfile.mkdtemp(prefix="kvflow-bench-")
    socket = f"{directory}/pool.sock"
    cmd = [sys.executable, "-m", "kvflow", "serve", "--socket", socket, "--capacity", str(capacity)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until_serving(socket, 120.0, proc)
        yield socket
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(directory, ignore_errors=True)


@contextmanager
def bench_store(kind: str, capacity: int) -> Iterator[Store]:
    """An open store of ``kind`` with ``capacity`` bytes, closed (and its server stopped) after."""
    if kind == "local":
        store: Store = LocalStore(capacity, prefault=True)
        try:
            yield store
        finally:
            store.close()
    elif kind == "shared":
        with pool_server(capacity) as socket:
            store = SharedStore(socket=socket, populate=True)
            try:
                yield store
            finally:
                store.close()
    else:
        raise ConfigError("store", kind, f"expected one of {STORE_KINDS}")
