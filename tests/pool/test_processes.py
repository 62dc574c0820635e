"""The pool across real processes: ``kvflow serve`` as a child process, clients in worker
processes (``tests/support/pool_workers.py``), crashes by SIGKILL on either side, and auto-start
races."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import kvflow
from kvflow import ChunkStatus
from kvflow.abc import WriteStatus
from kvflow.pool import PoolConfig
from kvflow.pool.launch import start_in_background
from tests.support.caches import make_caches
from tests.support.objects import read_objects, write_objects
from tests.support.pool_workers import NUM_PROMPTS, key_bytes
from tests.support.processes import (
    REPO,
    ServeProcess,
    Worker,
    live_server_pids,
    stop_servers,
    thread_affinities,
)
from tests.support.waits import wait_for_stats, wait_until

Serve = Callable[..., ServeProcess]
Workers = Callable[..., Worker]
SLOT = 8192


def stats_of(path: str) -> dict[str, int]:
    """The server's counters over a connection of their own."""
    store = kvflow.SharedStore(socket=path, timeout_s=60)
    try:
        return store.server_stats()
    finally:
        store.close()


def touch(path: str) -> None:
    with open(path, "w"):
        pass


def test_processes_share_prefixes_bit_exact(sock_dir: str, serve: Serve, workers: Workers) -> None:
    """Four processes save overlapping prompts and load everyone's, through a pool that holds a
    fraction of them (so eviction runs all along); every chunk loaded OK is bit-exact."""
    path = f"{sock_dir}/pool.sock"
    serve(path, 24 * 4096)  # 24 objects; the prompts have 2 + 6 + 24 = 32 distinct chunks
    go = f"{sock_dir}/go"
    procs = [
        workers(f"engine-{i}", "engine", socket=path, index=i, processes=4, seconds=2.0, go=go)
        for i in range(4)
    ]
    for w in procs:
        w.wait_ready(90)
    touch(go)
    results = [w.result(90) for w in procs]
    for r in results:
        assert r["mismatches"] == 0, r["errors"]
        assert r["failed"] == 0 and r["engine_failed_chunks"] == 0, r
        assert r["saves"] > 0 and r["loads"] >= NUM_PROMPTS
        assert r["loaded_ok"] > 0
    total = {k: sum(r[k] for r in results) for k in results[0] if k != "errors"}
    assert total["loaded_foreign"] > 0, total  # chunks other processes stored were read
    assert total["exists"] > 0, total  # the prompts' shared prefixes were saved concurrently
    stats = stats_of(path)
    assert stats["evictions"] > 0, stats
    assert (stats["pending_writes"], stats["leases"], stats["open_sessions"]) == (0, 0, 0)
    assert stats["released_on_disconnect"] == 0  # every worker finished its sessions itself


def test_client_killed_mid_write(sock_dir: str, serve: Serve, workers: Workers) -> None:
    path = f"{sock_dir}/pool.sock"
    serve(path, 6 * SLOT)
    before = stats_of(path)
    keys = [f"dying/{i}" for i in range(6)]  # the whole pool
    worker = workers("writer", "hold_writes", socket=path, keys=keys, nbytes=SLOT)
    ready = worker.wait_ready(60)
    assert ready["status"] == [WriteStatus.GRANTED] * 6 and ready["failed"] == []
    stats = stats_of(path)
    assert (stats["pending_writes"], stats["used"]) == (6, 6 * SLOT)
    worker.kill()
    assert worker.proc.returncode == -9
    store = kvflow.SharedStore(socket=path, timeout_s=60)
    try:
        stats = wait_for_stats(
            store.server_stats,
            lambda s: s["pending_writes"] == 0,
            60,
            "the dead writer's slots to come back",
        )
        assert stats["used"] == before["used"] == 0
        assert (stats["objects"], stats["open_sessions"]) == (0, 0)
        assert stats["released_on_disconnect"] == 1
        assert not store.lookup(keys).any()  # nothing of the half-written objects shows
        # every slot is reusable: the full pool fills again, with no eviction needed
        fresh = {f"fresh/{i}": key_bytes(f"fresh/{i}", SLOT) for i in range(6)}
        status = write_objects(store, fresh)
        assert (status == WriteStatus.GRANTED).all()
        stats = store.server_stats()
        assert (stats["objects"], stats["used"], stats["evictions"]) == (6, 6 * SLOT, 0)
        got = read_objects(store, list(fresh), SLOT)
        for key, want in fresh.items():
            np.testing.assert_array_equal(got[key], want)
        assert not store.lookup(keys).any()
    finally:
        store.close()


def test_client_killed_holding_leases(sock_dir: str, serve: Serve, workers: Workers) -> None:
    path = f"{sock_dir}/pool.sock"
    serve(path, 4 * SLOT)
    store = kvflow.SharedStore(socket=path, timeout_s=60)
    try:
        old = {f"old/{i}": key_bytes(f"old/{i}", SLOT) for i in range(4)}
        assert (write_objects(store, old) == WriteStatus.GRANTED).all()
        worker = workers("reader", "hold_leases", socket=path, keys=list(old))
        assert worker.wait_ready(60)["found"] == [True] * 4
        assert store.server_stats()["leases"] == 4
        # leased: nothing can be evicted, so there is no room
        session = store.open_write(["blocked"], SLOT)
        assert session.status.tolist() == [WriteStatus.NO_SPACE]
        store.finish_write(session, np.zeros(1, dtype=bool))
        worker.kill()
        stats = wait_for_stats(
            store.server_stats,
            lambda s: s["leases"] == 0,
            60,
            "the dead reader's leases to be released",
        )
        assert (stats["open_sessions"], stats["objects"]) == (0, 4)
        new = {f"new/{i}": key_bytes(f"new/{i}", SLOT) for i in range(4)}
        assert (write_objects(store, new) == WriteStatus.GRANTED).all()
        stats = store.server_stats()
        assert (stats["evictions"], stats["objects"]) == (4, 4)
        assert not store.lookup(list(old)).any()
        got = read_objects(store, list(new), SLOT)
        for key, want in new.items():
            np.testing.assert_array_equal(got[key], want)
    finally:
        store.close()


# -- the server crashes and comes back --------------------------------------------------------

BS = 16
CHUNK = 2


def prompt(chunks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30_000, chunks * CHUNK * BS)


def assert_blocks_equal(caches: list[Any], src: np.ndarray, dst: np.ndarray) -> None:
    for layer in caches:  # as bytes: random float16 bits include NaNs
        raw = layer.numpy().view(np.uint8)
        np.testing.assert_array_equal(raw[src], raw[dst])


async def test_server_killed_and_restarted(sock_dir: str, serve: Serve) -> None:
    path = f"{sock_dir}/pool.sock"
    server = serve(path, "16MiB")
    caches = make_caches(num_layers=4, num_blocks=64, seed=3)
    layout = kvflow.KVLayout.from_tensors(caches, block_size=BS)
    # Every timeout far above a stall of the machine: a dead server shows as errors at once
    # (its socket is closed), so what follows fails without waiting any timeout out, and
    # ``engine.stats().timeouts`` staying 0 says so without a clock.
    store = kvflow.SharedStore(socket=path, retry_interval_s=0.05, timeout_s=60)
    config = kvflow.EngineConfig(chunk_blocks=CHUNK, op_timeout_s=60, copy_timeout_s=60)
    engine = kvflow.TransferEngine(layout, store, config)
    try:
        tokens = prompt(4, seed=1)
        src = np.arange(0, 8)
        assert (await asyncio.wait_for(engine.save(tokens, src), 60)).ok
        assert await engine.lookup(tokens) == len(tokens)
        epoch = store.contents_epoch()
        assert epoch is not None

        # a load in flight when the server dies: its chunks fail, and no timeout had to end it
        dst = np.arange(8, 16)
        async with await engine.start_load([(tokens, dst)]) as handle:
            await handle.wait_layer(0, timeout=60)
            server.kill()
            result = await asyncio.wait_for(handle.wait(timeout=60), 90)
        status = result.requests[0].chunk_status
        assert (status == ChunkStatus.FAILED).all(), result
        assert not result.ok
        assert engine.stats().timeouts == 0

        # a dead server is an unavailable store, at once (not an answer waited for), and the
        # engine turns it into misses
        with pytest.raises(kvflow.StoreUnavailableError) as err:
            store.lookup(["any"])
        assert "did not answer" not in str(err.value), err.value
        assert await engine.lookup(tokens) == 0
        assert engine.stats().lookup_errors >= 1
        other = prompt(2, seed=2)
        saved = await asyncio.wait_for(engine.save(other, np.arange(16, 20)), 60)
        assert not saved.ok
        assert saved.count(ChunkStatus.OK) == 0
        assert engine.stats().store_errors >= 1
        assert engine.stats().timeouts == 0

        # the server comes back on the same path: the same store reconnects by itself
        reconnects = store.reconnects
        serve(path, "16MiB")

        def answers() -> bool:
            try:
                return not store.lookup(["any"]).any()
            except kvflow.StoreUnavailableError:
                return False

        wait_until(answers, 60, "the store to reconnect")
        assert store.reconnects == reconnects + 1
        assert store.contents_epoch() not in (None, epoch)  # what it held may be lost
        assert await engine.lookup(tokens) == 0  # a new pool: empty
        assert (await asyncio.wait_for(engine.save(tokens, src), 60)).ok
        assert await engine.lookup(tokens) == len(tokens)
        for layer in caches:
            layer[dst] = 0
        loaded = await asyncio.wait_for(engine.load(tokens, dst), 60)
        assert loaded.ok and loaded.count(ChunkStatus.OK) == 4
        assert_blocks_equal(caches, src, dst)
        stats = store.server_stats()
        assert (stats["leases"], stats["pending_writes"], stats["objects"]) == (0, 0, 4)
    finally:
        await engine.close()
        store.close()


# -- auto-start -------------------------------------------------------------------------------


def kvflow_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvflow", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_auto_start_race(sock_dir: str, workers: Workers) -> None:
    path = f"{sock_dir}/auto/pool.sock"  # nobody has created the directory yet either
    go, release = f"{sock_dir}/go", f"{sock_dir}/release"
    try:
        procs = [
            workers(f"auto-{i}", "autostart", socket=path, tag=str(i), go=go, release=release)
            for i in range(4)
        ]
        time.sleep(0.5)  # not synchronisation: lets the interpreters start before the go
        touch(go)
        reports = [w.wait_ready(90) for w in procs]
        for r in reports:
            assert r["found_own"] and r["found"] == [True, True], r
            assert r["failed"] == []
        # one server: every client saw the same instance and pid, and it serves them all
        assert len({r["instance"] for r in reports}) == 1
        pids = {r["server_pid"] for r in reports}
        assert len(pids) == 1 and 0 not in pids
        (pid,) = pids
        granted_common = [r["status"][1] for r in reports].count(WriteStatus.GRANTED)
        assert granted_common >= 1  # `auto/common`: written by one, EXISTS for the others
        live = wait_until(
            lambda: p if len(p := live_server_pids(path)) == 1 else None,
            60,
            "the servers that lost the race to exit",
        )
        assert live == [pid]
        # and only one was started: the clients took turns, the others found it serving
        with open(f"{path}.log") as f:
            log = f.read()
        started = [line for line in log.splitlines() if line.startswith("kvflow pool: serving")]
        assert len(started) == 1 and "already runs" not in log, log
        # the four workers and this stats connection (the losers' probes end on their own)
        stats = wait_until(
            lambda: s if (s := stats_of(path))["clients"] == 5 else None, 60, "five clients"
        )
        assert stats["objects"] == 5 and stats["capacity"] == 64 << 20
        touch(release)
        for w in procs:
            w.result(60)
        stopped = kvflow_cli("pool", "--socket", path, "stop")
        assert stopped.returncode == 0, stopped.stderr
        # `stop` returns once the socket refuses connections; the process exits just after
        wait_until(lambda: not os.path.exists(path), 60, "the socket to be removed")
        wait_until(lambda: not live_server_pids(path), 60, "the server process to exit")
    finally:
        touch(release)
        for pid in live_server_pids(path):
            os.kill(pid, signal.SIGKILL)


def test_an_auto_start_whose_server_fails_says_why_at_once(sock_dir: str) -> None:
    """A server that exits before serving (here its disk folder is a file) fails the start as
    soon as it exits, with the server's own words, not at the end of the start's timeout."""
    path = f"{sock_dir}/pool.sock"
    touch(f"{sock_dir}/a-file")
    config = PoolConfig(
        socket=path, capacity="8MiB", disk_dir=f"{sock_dir}/a-file", disk_capacity="16MiB"
    )
    with pytest.raises(kvflow.StoreUnavailableError, match=r"exited before serving.*not a dir"):
        start_in_background(config, 3600)  # far past the test's timeout
    assert not live_server_pids(path)


def test_auto_start_in_process_leaves_no_resource_warning(sock_dir: str) -> None:
    path = f"{sock_dir}/pool.sock"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            store = kvflow.SharedStore(
                socket=path, auto_start=True, capacity="8MiB", start_timeout_s=60
            )
            try:
                assert store.server_stats()["capacity"] == 8 << 20
            finally:
                store.close()
            gc.collect()
        leaked = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
        assert leaked == []
    finally:
        stop_servers(path)


def test_a_server_gone_under_load_is_restarted_beside_the_calls(sock_dir: str) -> None:
    """The first server is started in the constructor and waited for (one-time setup). When it
    dies, the next call does not wait for a new one to come up (a process, an arena: seconds
    in which every scheduler lookup would stall): it fails as a miss, a server starts beside,
    and a later call connects to it."""
    path = f"{sock_dir}/pool.sock"
    try:
        store = kvflow.SharedStore(
            socket=path, auto_start=True, capacity="8MiB", retry_interval_s=0.05
        )
        try:
            assert store.lookup(["k"]).tolist() == [False]
            (first,) = live_server_pids(path)
            os.kill(first, signal.SIGKILL)
            wait_until(lambda: not live_server_pids(path), 60, "the first server to die")
            with pytest.raises(kvflow.StoreUnavailableError):
                store.lookup(["k"])  # not waiting in the call for the new server

            def serving_again() -> bool:
                try:
                    return store.lookup(["k"]).tolist() == [False]
                except kvflow.StoreUnavailableError:
                    return False

            wait_until(serving_again, 60, "the store to reach a restarted server")
            one = lambda: len(pids := live_server_pids(path)) == 1 and pids  # noqa: E731
            (second,) = wait_until(one, 60, "the starting process to leave the server alone")
            assert second != first and store.reconnects == 2
        finally:
            store.close()
    finally:
        stop_servers(path)


def test_an_auto_started_server_leaves_openmp_thread_placement_behind(
    sock_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's CPU worker sets GOMP_CPU_AFFINITY to its compute cores and preloads libgomp,
    which pins the main thread of every process that inherits both: a server it starts gets
    the rest of the environment, not the placement (it imported for 16 s on a busy core)."""
    path = f"{sock_dir}/pool.sock"
    monkeypatch.setenv("GOMP_CPU_AFFINITY", "0")
    monkeypatch.setenv("OMP_PROC_BIND", "true")
    monkeypatch.setenv("KVFLOW_TEST_PASSED_ON", "yes")
    try:
        kvflow.SharedStore(socket=path, auto_start=True, capacity="8MiB").close()
        (pid,) = live_server_pids(path)
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if item)
        assert b"GOMP_CPU_AFFINITY" not in env and b"OMP_PROC_BIND" not in env
        assert env[b"KVFLOW_TEST_PASSED_ON"] == b"yes"
    finally:
        stop_servers(path)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_auto_start_from_a_thread_bound_to_a_compute_core_puts_the_server_elsewhere(
    sock_dir: str,
) -> None:
    """vLLM's CPU worker binds its main thread to one compute core; a pool server it starts
    must not inherit that core (its replies would wait behind the model's threads): it gets
    the CPUs no thread of the starting process is bound to."""
    path = f"{sock_dir}/pool.sock"
    mine = os.sched_getaffinity(0)
    compute = min(mine)
    try:
        os.sched_setaffinity(0, {compute})
        store = kvflow.SharedStore(socket=path, auto_start=True, capacity="8MiB")
        store.close()
        os.sched_setaffinity(0, mine)
        (pid,) = live_server_pids(path)
        affinities = thread_affinities(pid)
        assert affinities and all(compute not in cpus for cpus in affinities)
    finally:
        os.sched_setaffinity(0, mine)
        stop_servers(path)
