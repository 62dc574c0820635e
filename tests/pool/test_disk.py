"""The disk tier's objects (``kvflow.pool.disk``): real files in a temporary directory, found
again by a second DiskObjects on the same directory; damage of every kind found and dropped;
eviction tail first; refusals at construction; a full filesystem (a small tmpfs)."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvflow.errors import ClosedError, ConfigError, InvalidArgumentError
from kvflow.pool import disk as disk_module
from kvflow.pool.disk import DiskObjects
from kvflow.pool.diskfiles import FORMAT_DIR, PAGE, object_name

LAYERS = 4
LAYER = 1000  # bytes per layer: ranges need not be page-aligned
PAYLOAD = LAYERS * LAYER
FILE = PAGE + PAYLOAD  # one page of header, then the payload
RANGES = [(i * LAYER, LAYER) for i in range(LAYERS)]


def payload(key: str, size: int = PAYLOAD) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def path_of(directory: Path, key: str) -> Path:
    name = object_name(key)
    return directory / FORMAT_DIR / "objects" / name[:2] / f"{name}.kvo"


def files(directory: Path, suffix: str) -> list[Path]:
    return sorted((directory / FORMAT_DIR / "objects").glob(f"*/*{suffix}"))


def put(disk: DiskObjects, *keys: str) -> None:
    for key in keys:
        assert disk.put(key, payload(key), RANGES)


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    return tmp_path / "disk"


@pytest.fixture
def open_disk(directory: Path) -> Iterator[Callable[..., DiskObjects]]:
    """``open_disk(capacity)``: a DiskObjects on ``directory`` (the one before is closed
    first, as a server that restarts); all are closed at the end."""
    opened: list[DiskObjects] = []

    def make(capacity: int | str = "1MiB") -> DiskObjects:
        for earlier in opened:
            earlier.close()
        opened.append(DiskObjects(directory, capacity))
        return opened[-1]

    yield make
    for disk in opened:
        disk.close()


@pytest.fixture
def disk(open_disk: Callable[..., DiskObjects]) -> DiskObjects:
    return open_disk()


# -- round trips --------------------------------------------------------------------------------


def test_objects_come_back_layer_by_layer_and_whole(disk: DiskObjects, directory: Path) -> None:
    keys = ["a", "b", "c"]
    put(disk, *keys)
    for key in keys:
        buf = np.zeros(PAYLOAD, dtype=np.uint8)
        for offset, length in reversed(RANGES):  # any order, into the caller's buffer
            assert disk.read(key, offset, length, buf[offset : offset + length])
        assert np.array_equal(buf, payload(key))
        whole = disk.read_all(key)
        assert whole is not None and np.array_equal(whole, payload(key))
    two = memoryview(bytearray(2 * LAYER))  # two layers in one read
    assert disk.read("b", LAYER, 2 * LAYER, two)
    assert bytes(two) == payload("b")[LAYER : 3 * LAYER].tobytes()
    s = disk.stats()
    assert (s.objects, s.bytes, s.writes, s.write_bytes) == (3, 3 * FILE, 3, 3 * PAYLOAD)
    assert (s.reads, s.read_bytes) == (3 * LAYERS + 4, 6 * PAYLOAD + 2 * LAYER)
    assert (s.io_errors, s.corrupt, s.evictions, s.recovered, s.discarded) == (0, 0, 0, 0, 0)
    assert [p.stat().st_size for p in files(directory, ".kvo")] == [FILE] * 3
    assert files(directory, ".tmp") == []
    assert (directory / FORMAT_DIR / "objects").stat().st_mode & 0o777 == 0o700


def test_a_payload_may_be_bytes_with_ranges_in_any_order(disk: DiskObjects) -> None:
    data = payload("k").tobytes()
    assert disk.put("k", data, list(reversed(RANGES)))
    back = disk.read_all("k")
    assert back is not None and back.tobytes() == data


def test_lookup_counts_hits_and_misses(disk: DiskObjects) -> None:
    put(disk, "a", "b")
    assert disk.lookup(["a", "x", "b", "y", "z"]).tolist() == [True, False, True, False, False]
    s = disk.stats()
    assert (s.hits, s.misses) == (2, 3)
    disk.touch(["a", "nothing"])  # not counted
    assert disk.stats().hits == 2


def test_a_stored_key_is_not_written_again(disk: DiskObjects) -> None:
    put(disk, "a")
    assert disk.put("a", payload("other"), RANGES)
    assert disk.stats().writes == 1
    assert np.array_equal(disk.read_all("a"), payload("a"))  # type: ignore[arg-type]


def test_missing_keys_read_nothing(disk: DiskObjects) -> None:
    out = np.zeros(LAYER, dtype=np.uint8)
    assert not disk.read("nope", 0, LAYER, out)
    assert disk.read_all("nope") is None
    assert disk.stats().corrupt == 0


def test_remove_deletes_the_file(disk: DiskObjects, directory: Path) -> None:
    put(disk, "a", "b")
    assert disk.remove("a")
    assert not disk.remove("a")
    assert disk.lookup(["a", "b"]).tolist() == [False, True]
    assert files(directory, ".kvo") == [path_of(directory, "b")]
    assert disk.stats().bytes == FILE


def test_a_closed_tier_refuses_calls(disk: DiskObjects) -> None:
    put(disk, "a")
    disk.close()
    with pytest.raises(ClosedError):
        disk.lookup(["a"])
    with pytest.raises(ClosedError):
        disk.put("b", payload("b"), RANGES)
    assert disk.stats().objects == 1


# -- bad arguments: refused before anything is written -------------------------------------------


@pytest.mark.parametrize(
    ("key", "data", "ranges", "argument"),
    [
        (b"a", payload("a"), RANGES, "key"),
        ("\udc80", payload("a"), RANGES, "key"),
        ("k" * 70_000, payload("a"), RANGES, "key"),
        ("a", payload("a"), [(0, 2000), (1500, 2500)], "ranges"),  # overlapping
        ("a", payload("a"), [(0, 1000), (2000, 2000)], "ranges"),  # a gap
        ("a", payload("a"), [(0, 3000)], "ranges"),  # not covering
        ("a", payload("a"), [(0, 3000), (3000, 1001)], "ranges"),  # outside
        ("a", payload("a"), [], "ranges"),
        ("a", payload("a"), [(0, 0), (0, PAYLOAD)], "ranges"),  # an empty range
        ("a", payload("a"), [("x", 1)], "ranges"),
        ("a", b"", [], "payload"),
        ("a", payload("a", 2 * PAYLOAD)[::2], RANGES, "payload"),  # not contiguous
        ("a", 42, RANGES, "payload"),
    ],
)
def test_bad_put_arguments_are_refused(
    disk: DiskObjects, directory: Path, key: object, data: object, ranges: object, argument: str
) -> None:
    with pytest.raises(InvalidArgumentError) as info:
        disk.put(key, data, ranges)  # type: ignore[arg-type]
    assert info.value.argument == argument
    assert files(directory, "") == []
    assert disk.stats().writes == 0


@pytest.mark.parametrize(
    ("offset", "length", "argument"),
    [(10, LAYER - 10, "offset"), (0, LAYER + 1, "length"), (0, 0, "length"),
     (LAYER, 5 * LAYER, "length"), (PAYLOAD, LAYER, "offset")],
)  # fmt: skip
def test_a_read_must_cover_whole_ranges(
    disk: DiskObjects, offset: int, length: int, argument: str
) -> None:
    put(disk, "a")
    with pytest.raises(InvalidArgumentError) as info:
        disk.read("a", offset, length, np.zeros(length, dtype=np.uint8))
    assert info.value.argument == argument
    assert disk.lookup(["a"]).all()


def test_a_read_needs_a_writable_buffer_of_its_length(disk: DiskObjects) -> None:
    put(disk, "a")
    for out in (np.zeros(LAYER + 1, dtype=np.uint8), bytes(LAYER), "text"):
        with pytest.raises(InvalidArgumentError) as info:
            disk.read("a", 0, LAYER, out)
        assert info.value.argument == "out"


# -- persistence and damage ----------------------------------------------------------------------


def test_a_restart_finds_every_object_bit_exact(
    open_disk: Callable[..., DiskObjects], directory: Path
) -> None:
    keys = [f"k{i}" for i in range(6)]
    first = open_disk()
    put(first, *keys)
    first.close()
    again = open_disk()
    s = again.stats()
    assert (s.objects, s.bytes, s.recovered, s.discarded) == (6, 6 * FILE, 6, 0)
    assert again.lookup(keys).all()
    for key in keys:
        assert np.array_equal(again.read_all(key), payload(key))  # type: ignore[arg-type]


def test_a_torn_write_is_removed_at_start(
    open_disk: Callable[..., DiskObjects], directory: Path
) -> None:
    put(open_disk(), "a")
    torn = path_of(directory, "b").with_suffix(".tmp")
    torn.parent.mkdir(exist_ok=True)
    torn.write_bytes(b"KVFD" + bytes(100))
    again = open_disk()
    assert not torn.exists()
    assert again.lookup(["a", "b"]).tolist() == [True, False]
    assert (again.stats().recovered, again.stats().discarded) == (1, 0)


def test_a_flipped_payload_byte_fails_the_read_and_drops_the_object(
    disk: DiskObjects, directory: Path
) -> None:
    put(disk, "a", "b")
    path = path_of(directory, "a")
    with path.open("r+b") as f:
        f.seek(PAGE + 2 * LAYER + 7)  # in layer 2
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    out = np.zeros(LAYER, dtype=np.uint8)
    assert disk.read("a", 0, LAYER, out)  # layer 0 is intact: it verifies alone
    assert not disk.read("a", 2 * LAYER, LAYER, out)
    s = disk.stats()
    assert (s.corrupt, s.io_errors, s.objects) == (1, 0, 1)
    assert disk.lookup(["a", "b"]).tolist() == [False, True]
    assert not path.exists()
    assert disk.read_all("a") is None


def test_a_payload_flipped_before_a_restart_is_found_on_read(
    open_disk: Callable[..., DiskObjects], directory: Path
) -> None:
    put(open_disk(), "a")
    path = path_of(directory, "a")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80
    path.write_bytes(bytes(data))
    again = open_disk()
    assert again.stats().recovered == 1  # payloads are not read at start
    assert again.read_all("a") is None
    assert (again.stats().corrupt, again.stats().objects) == (1, 0)


def test_a_file_truncated_while_open_fails_its_read(disk: DiskObjects, directory: Path) -> None:
    put(disk, "a")
    os.truncate(path_of(directory, "a"), FILE - 10)
    out = np.zeros(LAYER, dtype=np.uint8)
    assert not disk.read("a", 3 * LAYER, LAYER, out)
    assert (disk.stats().corrupt, disk.stats().objects) == (1, 0)
    assert not path_of(directory, "a").exists()


def test_a_file_gone_while_open_fails_its_read(disk: DiskObjects, directory: Path) -> None:
    put(disk, "a")
    path_of(directory, "a").unlink()
    assert disk.read_all("a") is None
    assert (disk.stats().corrupt, disk.stats().objects, disk.stats().bytes) == (1, 0, 0)


@pytest.mark.parametrize(
    ("damage", "at"),
    [("truncate", FILE - 1), ("flip", 0), ("flip", 4), ("flip", 12), ("flip", 24),
     ("flip", 30), ("flip", 24 + 1 + 20 * LAYERS), ("extend", FILE + 1)],
    ids=["truncated", "magic", "version", "payload-size", "key", "range", "header-crc",
         "longer"],
)  # fmt: skip
def test_a_damaged_header_or_size_is_discarded_at_start(
    open_disk: Callable[..., DiskObjects], directory: Path, damage: str, at: int
) -> None:
    put(open_disk(), "a", "b")
    path = path_of(directory, "a")
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[at] ^= 0x01
    else:
        data = data[:at] if damage == "truncate" else data + b"\0"
    path.write_bytes(bytes(data))
    again = open_disk()
    assert (again.stats().recovered, again.stats().discarded) == (1, 1)
    assert again.lookup(["a", "b"]).tolist() == [False, True]
    assert not path.exists()


def test_a_file_under_another_key_s_name_is_discarded_at_start(
    open_disk: Callable[..., DiskObjects], directory: Path
) -> None:
    first = open_disk()
    put(first, "a", "b")
    first.close()
    os.replace(path_of(directory, "a"), path_of(directory, "b"))
    again = open_disk()
    assert (again.stats().recovered, again.stats().discarded) == (0, 1)
    assert files(directory, ".kvo") == []


def test_a_file_under_another_key_s_name_fails_its_checksums(
    disk: DiskObjects, directory: Path
) -> None:
    """The same layout, another key's bytes: the ranges' checksums are seeded with the key."""
    put(disk, "a", "b")
    path_of(directory, "b").write_bytes(path_of(directory, "a").read_bytes())
    assert disk.read_all("b") is None
    assert disk.stats().corrupt == 1


def test_another_format_s_directory_is_ignored(
    directory: Path, open_disk: Callable[..., DiskObjects], caplog: pytest.LogCaptureFixture
) -> None:
    old = directory / "kvflow-disk-v0" / "objects" / "ab" / ("ab" + "0" * 30 + ".kvo")
    old.parent.mkdir(parents=True)
    old.write_bytes(b"an older format")
    with caplog.at_level(logging.INFO, logger="kvflow.pool"):
        disk = open_disk()
    assert "kvflow-disk-v0" in caplog.text
    assert (disk.stats().recovered, disk.stats().discarded) == (0, 0)
    assert old.read_bytes() == b"an older format"


def test_the_order_at_start_is_the_files_modification_order(
    open_disk: Callable[..., DiskObjects], directory: Path
) -> None:
    put(open_disk(), "a0", "a1", "a2", "a3")
    for i, key in enumerate(["a2", "a0", "a3", "a1"]):  # oldest first
        os.utime(path_of(directory, key), ns=(10**18 + i, 10**18 + i))
    again = open_disk(4 * FILE)
    put(again, "x")
    assert again.lookup(["a0", "a1", "a2", "a3"]).tolist() == [True, True, False, True]


def test_a_smaller_capacity_at_start_evicts_the_oldest(
    open_disk: Callable[..., DiskObjects], directory: Path
) -> None:
    put(open_disk(), "a0", "a1", "a2")
    os.utime(path_of(directory, "a1"), ns=(1, 1))
    again = open_disk(2 * FILE)
    assert (again.stats().objects, again.stats().evictions) == (2, 1)
    assert again.lookup(["a0", "a1", "a2"]).tolist() == [True, False, True]
    assert not path_of(directory, "a1").exists()


# -- eviction: tail first -------------------------------------------------------------------------


def evicted_by(disk: DiskObjects, candidates: list[str], *new: str) -> list[str]:
    """Put ``new`` into the full tier; the ``candidates`` it pushed out."""
    before = disk.stats().evictions
    put(disk, *new)
    assert disk.stats().evictions == before + len(new)
    found = disk.lookup(candidates).tolist()
    return [key for key, f in zip(candidates, found, strict=True) if not f]


@pytest.fixture
def full(open_disk: Callable[..., DiskObjects]) -> DiskObjects:
    """A tier of room for four objects, ``a0``..``a3`` stored, the head ``a0`` put last."""
    disk = open_disk(4 * FILE)
    put(disk, "a3", "a2", "a1", "a0")
    return disk


KEYS = ["a0", "a1", "a2", "a3"]


def test_a_lookup_touches_a_prefix_tail_first(full: DiskObjects) -> None:
    full.touch(["a3"])  # the tail the most recent...
    assert full.lookup(KEYS).all()  # ...until the prefix is looked up
    assert evicted_by(full, KEYS, "x") == ["a3"]


def test_touch_orders_a_prefix_head_newest(full: DiskObjects) -> None:
    full.touch(["a2", "a3"])
    full.touch(KEYS)
    assert evicted_by(full, KEYS, "x", "y") == ["a2", "a3"]


def test_without_a_touch_the_least_recently_put_goes_first(full: DiskObjects) -> None:
    assert evicted_by(full, KEYS, "x") == ["a3"]
    full.touch(["a0", "a1", "a2"])
    assert evicted_by(full, ["a0", "a1", "a2", "x"], "y") == ["x"]


def test_an_object_larger_than_the_tier_is_refused(full: DiskObjects) -> None:
    assert not full.put("big", payload("big", 5 * FILE), [(0, 5 * FILE)])
    assert full.stats().evictions == 0
    assert full.lookup(KEYS).all()


def test_an_object_being_read_is_never_evicted_or_removed(
    full: DiskObjects, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a3 (the least recently used) is read, a put evicts a2 instead, and a put of a
    key whose put is under way writes nothing."""
    real_read = disk_module.read_into
    seen: list[object] = []

    def read_meanwhile(path: str, view: memoryview, at: int) -> int:
        seen.extend([full.put("x", payload("x"), RANGES), full.remove("a3")])
        return real_read(path, view, at)

    monkeypatch.setattr(disk_module, "read_into", read_meanwhile)
    assert full.read("a3", 0, LAYER, np.zeros(LAYER, dtype=np.uint8))
    assert seen == [True, False]
    assert full.lookup([*KEYS, "x"]).tolist() == [True, True, False, True, True]


def test_a_second_put_of_a_key_being_written_writes_nothing(
    disk: DiskObjects, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = disk_module.write_object
    seen: list[object] = []

    def write_meanwhile(path: str, header: bytes, data: memoryview) -> None:
        seen.extend([disk.put("a", payload("a"), RANGES), disk.lookup(["a"]).tolist()])
        real_write(path, header, data)

    monkeypatch.setattr(disk_module, "write_object", write_meanwhile)
    assert disk.put("a", payload("a"), RANGES)
    assert seen == [False, [False]]
    assert disk.stats().writes == 1


def test_a_put_of_a_key_being_deleted_writes_nothing(
    disk: DiskObjects, directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Else the deletion under way could take the new file, or clear the new put's mark."""
    real_unlink = disk_module.unlink_quietly
    seen: list[bool] = []

    def unlink_meanwhile(path: str) -> None:
        seen.append(disk.put("a", payload("a"), RANGES))
        real_unlink(path)

    put(disk, "a")
    monkeypatch.setattr(disk_module, "unlink_quietly", unlink_meanwhile)
    assert disk.remove("a")
    assert seen == [False]
    monkeypatch.undo()
    put(disk, "a")
    assert path_of(directory, "a").exists() and disk.read_all("a") is not None


def test_threads_leave_the_index_and_the_files_in_step(
    open_disk: Callable[..., DiskObjects], directory: Path
) -> None:
    """Puts, reads, lookups and removes of overlapping keys from four threads, the tier full:
    every read that succeeds has the right bytes, and at the end the index matches the files."""
    disk = open_disk(6 * FILE)
    bad: list[str] = []

    def work(seed: int) -> None:
        rng = np.random.default_rng(seed)
        out = np.zeros(LAYER, dtype=np.uint8)
        for _ in range(150):
            key = f"k{int(rng.integers(12))}"
            roll = rng.random()
            if roll < 0.4:
                disk.put(key, payload(key), RANGES)
            elif roll < 0.8:
                layer = int(rng.integers(LAYERS))
                ok = disk.read(key, layer * LAYER, LAYER, out)
                if ok and not np.array_equal(
                    out, payload(key)[layer * LAYER : (layer + 1) * LAYER]
                ):
                    bad.append(key)
            elif roll < 0.9:
                disk.lookup([key, f"k{int(rng.integers(12))}"])
            else:
                disk.remove(key)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert bad == []
    s = disk.stats()
    on_disk = files(directory, ".kvo")
    assert (s.objects, s.bytes) == (len(on_disk), sum(p.stat().st_size for p in on_disk))
    assert s.bytes <= 6 * FILE and (s.corrupt, s.io_errors) == (0, 0)
    assert files(directory, ".tmp") == []
    stored = [f"k{i}" for i in range(12) if disk.lookup([f"k{i}"])[0]]
    assert sorted(path_of(directory, key) for key in stored) == on_disk


# -- refusals at construction ---------------------------------------------------------------------


def statvfs_with_free(free: int) -> Callable[[str], os.statvfs_result]:
    real = os.statvfs

    def fake(path: str) -> os.statvfs_result:
        st = real(path)
        fields = list(st)
        fields[4] = free // st.f_frsize  # f_bavail
        return os.statvfs_result(fields)

    return fake


def test_a_capacity_beyond_the_free_space_is_refused(
    directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "statvfs", statvfs_with_free(1 << 20))
    with pytest.raises(ConfigError) as info:
        DiskObjects(directory, (1 << 20) + PAGE)
    assert info.value.argument == "disk_capacity"
    assert not directory.exists()
    DiskObjects(directory, 1 << 20).close()
    assert directory.is_dir()


def test_what_the_tier_holds_counts_as_room(
    open_disk: Callable[..., DiskObjects], directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    put(open_disk(), "a", "b")
    monkeypatch.setattr(os, "statvfs", statvfs_with_free(0))
    assert open_disk(2 * FILE).stats().objects == 2
    with pytest.raises(ConfigError, match="disk_capacity"):
        DiskObjects(directory, 2 * FILE + 1)
    assert files(directory, ".kvo") != []


def test_a_capacity_under_a_page_is_refused(directory: Path) -> None:
    for capacity in (PAGE - 1, "1KiB", -1):
        with pytest.raises(ConfigError) as info:
            DiskObjects(directory, capacity)
        assert info.value.argument == "disk_capacity"
    assert not directory.exists()


def test_a_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_bytes(b"x")
    for path in (file, file / "under"):
        with pytest.raises(ConfigError) as info:
            DiskObjects(path, "1MiB")
        assert info.value.argument == "disk_dir"
    assert file.read_bytes() == b"x"
    assert sorted(tmp_path.iterdir()) == [file]


def test_an_unwritable_directory_is_refused(tmp_path: Path) -> None:
    """A directory this user cannot write: mode 0500, or (for root, who writes there anyway) a
    filesystem mounted read-only."""
    directory = tmp_path / "ro"
    directory.mkdir(mode=0o500)
    mounted = False
    if os.access(directory, os.W_OK):  # root: a read-only tmpfs instead
        _mount(directory, "ro,size=1m")
        mounted = True
    try:
        with pytest.raises(ConfigError) as info:
            DiskObjects(directory, "4KiB")
        assert info.value.argument == "disk_dir"
        assert list(directory.iterdir()) == []
    finally:
        if mounted:
            _umount(directory)
        directory.chmod(0o700)


# -- a full filesystem ----------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs mounted for the test (unmounted whatever happens)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    _mount(mount, "size=1m")
    try:
        yield mount
    finally:
        _umount(mount)


def _mount(path: Path, options: str) -> None:
    """A tmpfs on ``path`` (the tests run as root here and in CI; elsewhere they skip)."""
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        reason = f"cannot mount a tmpfs: {done.stderr.strip() or done.returncode}"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


def _umount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], check=False).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_filesystem_fails_puts_without_harm(
    small_fs: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(os, "statvfs", statvfs_with_free(64 << 20))  # room it has not
    disk = DiskObjects(small_fs / "disk", "64MiB")
    size = 60 * 1024
    ranges = [(0, size // 2), (size // 2, size // 2)]
    stored: list[str] = []
    with caplog.at_level(logging.WARNING, logger="kvflow.pool"):
        for i in range(40):
            key = f"k{i}"
            if not disk.put(key, payload(key, size), ranges):
                break
            stored.append(key)
        else:
            pytest.fail("40 puts of 60 KiB fit in a 1 MiB filesystem")
        assert not disk.put("again", payload("again", size), ranges)
    s = disk.stats()
    assert (s.no_space, s.io_errors, s.objects) == (2, 2, len(stored))
    assert len(stored) >= 10, stored
    assert len([r for r in caplog.records if "failed" in r.getMessage()]) == 1  # rate-limited
    assert list((small_fs / "disk").rglob("*.tmp")) == []
    for key in stored:
        assert np.array_equal(disk.read_all(key), payload(key, size))  # type: ignore[arg-type]
    assert disk.remove(stored[0])
    assert disk.put("after", payload("after", size), ranges)  # room again
    disk.close()
