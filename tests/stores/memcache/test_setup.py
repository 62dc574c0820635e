"""MemcacheStore's own setup path (the one it takes without ``client=``), driven through a
stand-in ``memcache_hybrid`` module: LocalConfig from the config, or memcache's config file;
setup and init answers translated; an init that never returns bounded. And ``import kvflow``
without memcache_hybrid."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import kvflow
from kvflow.stores.memcache.config import LOCAL_CONFIG_ENV
from tests.support.gates import Gate
from tests.support.memcache_standin import LocalConfigStandIn, MemcacheStandIn, standin_module

META = "tcp://127.0.0.1:5000"
STORE = "tcp://127.0.0.1:6000"


class Made:
    """The ``DistributedObjectStore`` of a stand-in ``memcache_hybrid``: makes stand-in clients,
    each first passed to ``prepare``, and keeps them."""

    def __init__(self) -> None:
        self.clients: list[MemcacheStandIn] = []
        self.prepare: Callable[[MemcacheStandIn], object] = lambda client: None

    def __call__(self) -> MemcacheStandIn:
        client = MemcacheStandIn(1 << 20)
        self.prepare(client)
        self.clients.append(client)
        return client


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> Iterator[Made]:
    """``memcache_hybrid`` is a stand-in module for the test."""
    factory = Made()
    monkeypatch.setitem(sys.modules, "memcache_hybrid", standin_module(factory))
    monkeypatch.delenv(LOCAL_CONFIG_ENV, raising=False)
    yield factory
    for client in factory.clients:
        for event in client._stalls.values():
            event.set()


def test_setup_from_the_urls_then_init_on_the_device(made: Made) -> None:
    store = kvflow.MemcacheStore(
        meta_service_url=META,
        config_store_url=STORE,
        protocol="host_tcp",
        dram_size="64MiB",
        device_id=5,
        timeout_s=3,
    )
    client = made.clients[0]
    assert [c.name for c in client.calls] == ["setup", "init"]
    local = client.calls[0].args[0]
    assert isinstance(local, LocalConfigStandIn)
    assert (local.meta_service_url, local.config_store_url) == (META, STORE)
    assert (local.protocol, local.dram_size, local.client_timeout_seconds) == (
        "host_tcp",
        "67108864",
        3,
    )
    assert client.calls[1].args == (5, True)
    store.close()
    assert client.names()[-1] == "close"  # the store made this client: it closes it


def test_a_config_file_is_read_by_memcache_itself(
    made: Made, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = tmp_path / "mmc-local.conf"
    conf.write_text("ock.mmc.meta_service_url = tcp://127.0.0.1:5000\n")
    monkeypatch.setenv(LOCAL_CONFIG_ENV, str(conf))  # as memcache needs it: before its import
    store = kvflow.MemcacheStore(local_config_path=str(conf))
    assert made.clients[0].names() == ["init"]  # no setup: init reads $MMC_LOCAL_CONFIG_PATH
    store.close()


def test_a_config_file_named_after_memcache_s_import_is_refused(made: Made, tmp_path: Path) -> None:
    """libmf_memcache reads $MMC_LOCAL_CONFIG_PATH when memcache_hybrid is imported (seen on the
    real 1.3.0 binding): naming the file later would leave init without a config."""
    conf = tmp_path / "mmc-local.conf"
    conf.write_text("")
    with pytest.raises(kvflow.ConfigError, match="imported before") as err:
        kvflow.MemcacheStore(local_config_path=str(conf))
    assert err.value.argument == "local_config_path"
    assert made.clients == [] and LOCAL_CONFIG_ENV not in os.environ


def test_a_config_file_other_than_the_environment_s_is_refused(
    made: Made, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf = tmp_path / "mine.conf"
    conf.write_text("")
    monkeypatch.setenv(LOCAL_CONFIG_ENV, str(tmp_path / "theirs.conf"))
    with pytest.raises(kvflow.ConfigError, match=r"theirs\.conf") as err:
        kvflow.MemcacheStore(local_config_path=str(conf))
    assert err.value.argument == "local_config_path"
    assert made.clients == []


def test_setup_refused(made: Made) -> None:
    made.prepare = lambda client: setattr(client, "setup_answer", -3000)
    with pytest.raises(kvflow.StoreUnavailableError, match=META) as err:
        kvflow.MemcacheStore(meta_service_url=META, config_store_url=STORE)
    assert err.value.code == -3000


def test_init_failure_names_the_device_and_the_code(made: Made) -> None:
    """What the real client answers on a machine without an Ascend driver: init returns -1."""
    made.prepare = lambda client: setattr(client, "init_answer", -1)
    with pytest.raises(kvflow.StoreUnavailableError) as err:
        kvflow.MemcacheStore(meta_service_url=META, config_store_url=STORE, device_id=7)
    assert err.value.code == -1
    assert "device 7" in str(err.value) and "Ascend" in str(err.value)
    assert made.clients[0].names() == ["setup", "init", "close"]


def test_an_init_that_never_returns_is_bounded(made: Made) -> None:
    """memcache's init retries the config store for as long as the meta service is away."""
    gates: list[Gate] = []
    made.prepare = lambda client: gates.append(client.stall("init"))
    with pytest.raises(kvflow.StoreUnavailableError, match=r"did not return within 0.3 s"):
        kvflow.MemcacheStore(meta_service_url=META, config_store_url=STORE, init_timeout_s=0.3)
    # the caller had its answer while init was still held: bounded by init_timeout_s, not init
    assert gates[0].passed == 0
    assert gates[0].reached.wait(60)  # (on a stalled machine init may only start now)
    assert made.clients[0].names() == ["setup", "init"]  # not closed under a running init


def test_kvflow_imports_without_memcache_and_names_the_extra() -> None:
    """In a process where ``memcache_hybrid`` cannot be imported."""
    code = (
        "import sys; sys.modules['memcache_hybrid'] = None\n"
        "import kvflow\n"
        "assert 'memcache_hybrid' not in [m for m in sys.modules if sys.modules[m]]\n"
        "try:\n"
        "    kvflow.MemcacheStore(meta_service_url='tcp://127.0.0.1:5000',\n"
        "                         config_store_url='tcp://127.0.0.1:6000')\n"
        "except kvflow.MissingDependencyError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "MissingDependencyError" in out.stdout
    assert "kvflow[memcache]" in out.stdout


def test_import_kvflow_does_not_import_memcache() -> None:
    code = "import sys, kvflow; print('memcache_hybrid' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "False"
