"""The pools a benchmark can run on, each set up as a user would deploy it.

* ``local``: a LocalStore in the benchmark's process (prefaulted).
* ``shared``: a ``kvflow serve`` process of its own, in a fresh private directory, and a
  SharedStore connected to it (the arena mapped at connect).
* ``mooncake``: a MooncakeStore whose own segment holds the capacity, on the master at
  ``$KVFLOW_MOONCAKE_MASTER_SERVER_ADDRESS`` when set, else on a ``mooncake_master`` of its own
  on 127.0.0.1 (TCP transport, ``P2PHANDSHAKE``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

from kvflow.errors import ConfigError
from kvflow.pool.launch import wait_until_serving
from kvflow.pool.store import SharedStore
from kvflow.stores.base import Store
from kvflow.stores.local import LocalStore

if TYPE_CHECKING:
    from kvflow.stores.mooncake import MooncakeStore

__all__ = ["STORE_KINDS", "bench_store", "mooncake_store", "pool_server"]

STORE_KINDS = ("local", "shared", "mooncake")


@contextmanager
def pool_server(capacity: int, *extra: str) -> Iterator[str]:
    """A ``kvflow serve`` subprocess with ``capacity`` bytes and ``extra`` options; yields its
    socket path."""
    directory = tempfile.mkdtemp(prefix="kvflow-bench-")
    socket = f"{directory}/pool.sock"
    cmd = [sys.executable, "-m", "kvflow", "serve", "--socket", socket, "--capacity", str(capacity)]
    cmd += extra
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
    elif kind == "mooncake":
        with mooncake_store(capacity) as store:
            yield store
    else:
        raise ConfigError("store", kind, f"expected one of {STORE_KINDS}")


@contextmanager
def mooncake_store(capacity: int) -> Iterator[MooncakeStore]:
    """A MooncakeStore with a segment of ``capacity`` bytes (16 MiB at least), on the master
    named in the environment or on one started for it; closed (and that master stopped) after."""
    from kvflow.stores.mooncake import MooncakeStore
    from kvflow.stores.mooncake.config import ENV_PREFIX
    from kvflow.stores.mooncake.master import MooncakeMaster

    with ExitStack() as stack:
        address = os.environ.get(ENV_PREFIX + "MASTER_SERVER_ADDRESS")
        if not address:
            address = stack.enter_context(MooncakeMaster()).address
        store = MooncakeStore(
            master_server_address=address,
            local_hostname=os.environ.get(ENV_PREFIX + "LOCAL_HOSTNAME", "127.0.0.1"),
            global_segment_size=max(capacity, 16 << 20),
            key_prefix=f"kvflow-bench-{os.getpid()}/",
        )
        try:
            yield store
        finally:
            store.close()
