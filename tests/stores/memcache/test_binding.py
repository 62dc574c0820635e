"""Against the real ``memcache_hybrid`` (skipped where it does not import). Its client cannot
store anything without Ascend hardware, so these prove what can be proved on this machine:

- the binding's signatures (from its pybind docstrings) are the stand-in's, name for name and
  default for default, and every call MemcacheStore makes binds to them with the documented
  element types; replayed on a real client, none is refused for its arguments;
- MemcacheStore's setup path reaches a real meta service (started here, on 127.0.0.1) and
  fails exactly where the hardware is required: ``init`` returns -1, raised as
  StoreUnavailableError naming the device and the code; without a meta service the init is
  bounded by ``init_timeout_s``.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvflow
from kvflow.stores.memcache import client as adapter
from kvflow.stores.memcache.config import MEDIA
from tests.support.memcache import CHUNK, layout_of, tokens
from tests.support.memcache_standin import KeyInfoStandIn, MemcacheStandIn
from tests.support.pools import memcache_standin_store, unavailable

REPO = Path(__file__).resolve().parents[2]
CALLS = (  # every client call MemcacheStore makes
    "setup",
    "init",
    "close",
    "register_buffer",
    "unregister_buffer",
    "batch_is_exist",
    "batch_get_key_info",
    "batch_alloc",
    "batch_copy",
    "batch_write_finish",
    "batch_add_lease",
    "batch_remove_lease",
    "remove_batch",
)
RETURNS = {  # what the adapter expects back: one code, or one answer per key
    "batch_copy": "int",
    "batch_remove_lease": "int",
    "register_buffer": "int",
    "unregister_buffer": "int",
    "batch_get_key_info": "list[_pymmc.KeyInfo]",
}


@pytest.fixture(scope="module")
def binding() -> Any:
    try:
        import memcache_hybrid
    except ImportError as exc:
        unavailable(f"memcache_hybrid does not import ({exc}); pip install 'kvflow[memcache]'")
    return memcache_hybrid


# -- signatures ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Documented:
    """A method's signature as its pybind docstring states it."""

    signature: inspect.Signature
    types: dict[str, str]
    returns: str


def documented(method: Any) -> Documented:
    line = method.__doc__.strip().splitlines()[0]
    match = re.fullmatch(r"\w+\(self: [\w.]+(?:, (.*))?\) -> (.+)", line)
    assert match, f"unexpected docstring: {line}"
    params, types = [], {}
    for part in _split_top_level(match.group(1) or ""):
        name, _, rest = part.partition(": ")
        kind, default = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.empty
        if re.fullmatch(r"arg\d+", name):  # pybind's name for an argument it does not name
            kind = inspect.Parameter.POSITIONAL_ONLY
        typ, eq, value = rest.partition(" = ")
        if eq:
            default = ast.literal_eval(value) if not value.startswith("<") else value
        types[name] = typ
        params.append(inspect.Parameter(name, kind, default=default))
    return Documented(inspect.Signature(params), types, match.group(2))


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "[(<"
        depth -= ch in "])>"
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    tail = text[start:].strip()
    return [*parts, tail] if tail else parts


@pytest.mark.parametrize("name", CALLS)
def test_the_stand_in_has_the_binding_s_signatures(binding: Any, name: str) -> None:
    real = documented(getattr(binding.DistributedObjectStore, name))
    ours = inspect.signature(getattr(MemcacheStandIn, name))
    ours_params = list(ours.parameters.values())[1:]  # without self
    assert [(p.name, p.kind) for p in ours_params] == [
        (p.name, p.kind) for p in real.signature.parameters.values()
    ]
    for mine, theirs in zip(ours_params, real.signature.parameters.values(), strict=True):
        if not isinstance(theirs.default, str):  # a ReplicateConfig object: not compared
            assert mine.default == theirs.default, f"{name}({mine.name}=...)"
    returns = real.returns.replace("_pymmc.KeyInfo", "KeyInfoStandIn")
    assert ours.return_annotation == returns
    if name in RETURNS:
        assert real.returns == RETURNS[name]


def test_key_info_and_constants_match(binding: Any) -> None:
    for method in ("size", "gva_list", "loc_list", "type_list"):
        real = documented(getattr(binding.KeyInfo, method))
        assert callable(getattr(KeyInfoStandIn, method))
        assert inspect.signature(getattr(KeyInfoStandIn, method)).return_annotation == real.returns
    directions = (binding.L2G, binding.G2L, binding.G2H, binding.H2G)
    assert [int(d) for d in directions] == [
        adapter.COPY_L2G,
        adapter.COPY_G2L,
        adapter.COPY_G2H,
        adapter.COPY_H2G,
    ]
    flag = documented(binding.DistributedObjectStore.batch_get_key_info).signature
    assert flag.parameters["flag"].default == adapter.READABLE  # the binding's own default
    alloc = documented(binding.DistributedObjectStore.batch_alloc).signature
    default = kvflow.MemcacheConfig(local_config_path=__file__).media_code
    assert alloc.parameters["media"].default == default == MEDIA["dram"]  # the binding's default


def test_local_config_takes_every_field_kvflow_sets(binding: Any) -> None:
    cfg = kvflow.MemcacheConfig(
        meta_service_url="tcp://10.1.2.3:5000",
        config_store_url="tcp://10.1.2.3:6000",
        protocol="host_tcp",
        dram_size="64MiB",
        timeout_s=7,
    )
    local = binding.LocalConfig()
    for name, value in cfg.local_config_fields().items():
        setattr(local, name, value)
        assert getattr(local, name) == value, name
    text = str(local)
    assert "tcp://10.1.2.3:5000" in text and "host_tcp" in text and "67108864" in text


class Recorder:
    """A client that records the calls made on it (args and kwargs as made) and forwards."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            return attr(*args, **kwargs)

        return call


class OldMemcache(MemcacheStandIn):
    batch_write_finish = None  # type: ignore[assignment]


def adapter_calls() -> list[tuple[str, tuple[Any, ...], dict[str, Any]]]:
    """Every call MemcacheStore makes, as made: a save, a lookup and a load through the engine,
    an abort, shared leases, a close with work open, and the path without batch_write_finish."""
    recorder = Recorder(MemcacheStandIn(8 << 20))
    store = memcache_standin_store(0, client=recorder)  # type: ignore[arg-type]
    caches, layout = layout_of(3)
    with kvflow.SyncTransferEngine(layout, store, kvflow.EngineConfig(chunk_blocks=CHUNK)) as e:
        ids = tokens(2)
        assert e.save(ids, np.arange(4)).ok and e.lookup(ids) == len(ids)
        assert e.load(ids, np.arange(8, 12)).ok
    store.open_write(["pending"], 4096)
    store.open_read([f"{i}" for i in range(2)])
    store.close()
    old = Recorder(OldMemcache(1 << 20))
    store = memcache_standin_store(0, client=old)  # type: ignore[arg-type]
    store.finish_write(store.open_write(["a"], 64), np.zeros(1, dtype=bool))
    return recorder.calls + old.calls


def test_every_adapter_call_binds_to_the_binding_s_signature(binding: Any) -> None:
    calls = adapter_calls()
    assert {c[0] for c in calls} == set(CALLS) - {"setup", "init", "close"}
    for name, args, kwargs in calls:
        real = documented(getattr(binding.DistributedObjectStore, name))
        bound = real.signature.bind(*args, **kwargs)
        for param, value in bound.arguments.items():
            typ = real.types[param]
            if typ == "collections.abc.Sequence[str]":
                assert isinstance(value, list) and all(isinstance(v, str) for v in value), name
            elif typ == "collections.abc.Sequence[typing.SupportsInt]":
                assert isinstance(value, list), f"{name}({param}) is {type(value).__name__}"
                assert all(isinstance(v, int) and not isinstance(v, bool) for v in value), name
            elif typ == "typing.SupportsInt":
                assert isinstance(value, int) and not isinstance(value, bool), f"{name}({param})"


_REPLAY = textwrap.dedent(
    """
    import json, os, pickle, sys
    import memcache_hybrid
    calls = pickle.loads(bytes.fromhex(sys.stdin.read()))
    client = memcache_hybrid.DistributedObjectStore()  # never initialised: answers, stores nothing
    out = []
    for name, args, kwargs in calls:
        try:
            got = getattr(client, name)(*args, **kwargs)
            out.append([name, type(got).__name__, len(got) if isinstance(got, list) else got])
        except TypeError as exc:
            out.append([name, "TypeError", str(exc)])
    print("REPLAY " + json.dumps(out), flush=True)
    os._exit(0)
    """
)


def test_the_real_binding_accepts_every_adapter_call(binding: Any) -> None:
    """Replayed on a real client (never initialised, so it answers "not initialised" and
    touches no memory), no call is refused for its arguments; the answers have the shapes the
    adapter expects: one code, or one entry per key (key information: none when down)."""
    import pickle

    calls = adapter_calls()
    proc = subprocess.run(
        [sys.executable, "-c", _REPLAY],
        input=pickle.dumps(calls).hex(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    replay = _marked(proc.stdout, "REPLAY")
    assert replay is not None, proc.stdout[-2000:] + proc.stderr[-2000:]
    for (name, args, _), (same, kind, value) in zip(calls, replay, strict=True):
        assert same == name
        assert kind != "TypeError", f"{name}: {value}"
        if RETURNS.get(name) == "int":
            assert kind == "int" and value == -3019, (name, value)
        elif name == "batch_get_key_info":
            assert (kind, value) == ("list", 0)  # the query failed as a whole
        else:
            assert (kind, value) == ("list", len(args[0])), name


def _marked(output: str, marker: str) -> Any:
    for line in output.splitlines():
        if line.startswith(marker + " "):
            return json.loads(line[len(marker) + 1 :])
    return None


# -- the setup path against a real meta service -------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_META = textwrap.dedent(
    """
    import sys
    from memcache_hybrid import MetaConfig, MetaService
    meta, store, metrics, logs = sys.argv[1:5]
    config = MetaConfig()
    config.meta_service_url = f"tcp://127.0.0.1:{meta}"
    config.config_store_url = f"tcp://127.0.0.1:{store}"
    config.metrics_url = f"http://127.0.0.1:{metrics}"
    config.log_path = logs
    print("SETUP", MetaService.setup(config), flush=True)
    MetaService.main()
    """
)


@dataclass
class MetaService:
    meta_url: str
    store_url: str
    store_port: int


@pytest.fixture(scope="module")
def meta_service(binding: Any) -> Iterator[MetaService]:
    """memcache's meta service, in a process of its own on free ports of 127.0.0.1."""
    ports = [_free_port() for _ in range(3)]
    logs = tempfile.mkdtemp(prefix="kvflow-mmc-")
    out = open(Path(logs) / "meta.out", "w+")  # noqa: SIM115 - read after the process ends
    proc = subprocess.Popen(
        [sys.executable, "-c", _META, *map(str, ports), logs], stdout=out, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 60
        while not all(_listening(p) for p in ports[:2]):
            if proc.poll() is not None:
                out.seek(0)
                text = out.read()
                if "already running" in text:
                    lock = "/tmp/mmc_meta_service.lock"
                    pytest.skip(f"another memcache meta service runs on this machine ({lock})")
                pytest.fail(f"the meta service exited ({proc.returncode}): {text[-2000:]}")
            assert time.monotonic() < deadline, "the meta service did not start listening"
            time.sleep(0.1)
        yield MetaService(f"tcp://127.0.0.1:{ports[0]}", f"tcp://127.0.0.1:{ports[1]}", ports[1])
    finally:
        proc.terminate()  # the meta service ends on SIGTERM
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(60)
        out.close()
        shutil.rmtree(logs, ignore_errors=True)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


_CLIENT = textwrap.dedent(
    """
    import json, os, sys
    import kvflow
    try:
        kvflow.MemcacheStore(kvflow.MemcacheConfig(**json.loads(sys.argv[1])))
        result = {"error": None}
    except kvflow.KVFlowError as exc:
        result = {"error": type(exc).__name__, "code": getattr(exc, "code", None),
                  "message": str(exc)}
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)  # an init still retrying in its thread must not hold the process
    """
)


def run_client(config: dict[str, Any], env: dict[str, str] | None = None) -> tuple[Any, str]:
    """MemcacheStore(MemcacheConfig(**config)) in a child process: its result, and its output
    (memcache's own log included)."""
    clean = {k: v for k, v in os.environ.items() if k != "MMC_LOCAL_CONFIG_PATH"}
    proc = subprocess.run(
        [sys.executable, "-c", _CLIENT, json.dumps(config)],
        cwd=REPO,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    output = proc.stdout + proc.stderr
    result = _marked(proc.stdout, "RESULT")
    assert result is not None, f"the client died ({proc.returncode}): {output[-3000:]}"
    return result, output


def test_setup_reaches_the_meta_service_and_init_fails_for_want_of_an_npu(
    meta_service: MetaService,
) -> None:
    result, log = run_client(
        {
            "meta_service_url": meta_service.meta_url,
            "config_store_url": meta_service.store_url,
            "protocol": "host_tcp",
            "dram_size": "64MiB",
            "device_id": 3,
            "init_timeout_s": 90,
        }
    )
    assert result["error"] == "StoreUnavailableError", result
    assert result["code"] == -1
    assert "memcache init on device 3 failed" in result["message"]
    assert meta_service.meta_url in result["message"]
    assert "mmc setup success" in log  # memcache took the LocalConfig kvflow built
    assert f"connect store success, ip:127.0.0.1:{meta_service.store_port}" in log
    assert "driver" in log  # and stopped at the NPU driver check


def test_a_config_file_reaches_the_meta_service_the_same_way(
    meta_service: MetaService, tmp_path: Path
) -> None:
    conf = tmp_path / "mmc-local.conf"
    conf.write_text(
        f"ock.mmc.meta_service_url = {meta_service.meta_url}\n"
        f"ock.mmc.local_service.config_store_url = {meta_service.store_url}\n"
        "ock.mmc.log_level = info\n"
        "ock.mmc.local_service.world_size = 256\n"
        "ock.mmc.local_service.protocol = host_tcp\n"
        "ock.mmc.local_service.dram.size = 64MB\n"
    )
    result, log = run_client({"local_config_path": str(conf), "device_id": 1})
    assert (result["error"], result["code"]) == ("StoreUnavailableError", -1), result
    assert "device 1" in result["message"] and str(conf) in result["message"]
    assert f"connect store success, ip:127.0.0.1:{meta_service.store_port}" in log


def test_without_a_meta_service_init_is_bounded(binding: Any) -> None:
    port = _free_port()  # nothing listens there
    result, log = run_client(
        {
            "meta_service_url": f"tcp://127.0.0.1:{_free_port()}",
            "config_store_url": f"tcp://127.0.0.1:{port}",
            "protocol": "host_tcp",
            "dram_size": "64MiB",
            "init_timeout_s": 2,
        }
    )
    assert result["error"] == "StoreUnavailableError", result
    # the timeout's own error: the caller gave up on an init still retrying (no clock needed;
    # run_client's bound fails a hang)
    assert "did not return within 2 s" in result["message"]
    assert f"Trying to connect to 127.0.0.1:{port}" in log  # memcache retrying, as it does
