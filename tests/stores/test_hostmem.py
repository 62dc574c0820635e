"""A capacity the machine cannot give is refused before any memory is mapped: the figures come
from /proc/meminfo and the memory cgroup (v2 and v1), read here from made-up trees."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvflow
from kvflow.stores.hostmem import HostMemory, check_capacity, read_host_memory

GiB = 1 << 30
TOO_BIG = "1TB"  # beyond every test machine; decimal, as a user writes it


def test_local_store_beyond_the_machine_is_refused() -> None:
    with pytest.raises(kvflow.ConfigError) as caught:
        kvflow.LocalStore(TOO_BIG)
    err = caught.value
    assert (err.argument, err.value) == ("capacity", TOO_BIG)
    text = str(err)
    assert "1,000,000,000,000 bytes" in text  # what was asked
    assert "MemAvailable" in text and "/proc/meminfo" in text  # what is available, and where from
    assert "smaller capacity" in text  # what to do
    assert "\n" not in text


def meminfo(root: Path, available_kib: int) -> None:
    (root / "self").mkdir(parents=True, exist_ok=True)
    (root / "meminfo").write_text(
        f"MemTotal:       99999999 kB\nMemFree:  1 kB\nMemAvailable:   {available_kib} kB\n"
    )


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_meminfo_alone(tmp_path: Path) -> None:
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    meminfo(proc, 8 << 20)  # 8 GiB
    write(proc / "self" / "cgroup", "0::/\n")
    memory = read_host_memory(proc=str(proc), cgroup_mount=str(cgroups))
    assert memory == HostMemory(mem_available=8 * GiB, cgroup_limit=None, cgroup_room=None)
    assert memory.available == 8 * GiB
    check_capacity(8 * GiB, "8GiB", memory)  # exactly what is there: taken
    with pytest.raises(kvflow.ConfigError) as caught:
        check_capacity(8 * GiB + 1, "8GiB+1", memory)
    assert "8.0 GiB" in str(caught.value) and "cgroup" not in str(caught.value)


def test_cgroup_v2_limit_of_this_process_or_a_parent(tmp_path: Path) -> None:
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    meminfo(proc, 64 << 20)  # 64 GiB on the machine
    write(proc / "self" / "cgroup", "0::/pod/worker\n")
    write(cgroups / "cgroup.controllers", "cpu memory\n")
    write(cgroups / "pod" / "memory.max", f"{16 * GiB}\n")  # the pod's limit binds
    write(cgroups / "pod" / "memory.current", f"{6 * GiB}\n")
    write(cgroups / "pod" / "memory.stat", f"anon 1\ninactive_file {2 * GiB}\n")
    write(cgroups / "pod" / "worker" / "memory.max", "max\n")
    write(cgroups / "pod" / "worker" / "memory.current", f"{1 * GiB}\n")
    memory = read_host_memory(proc=str(proc), cgroup_mount=str(cgroups))
    # 16 GiB limit, 6 GiB used of which 2 GiB is reclaimable file cache: 12 GiB left
    assert memory == HostMemory(mem_available=64 * GiB, cgroup_limit=16 * GiB, cgroup_room=12 * GiB)
    assert memory.available == 12 * GiB
    with pytest.raises(kvflow.ConfigError) as caught:
        check_capacity(13 * GiB, "13GiB", memory, hint="use a smaller --capacity")
    text = str(caught.value)
    assert "12.0 GiB" in text and "16.0 GiB" in text and "cgroup" in text
    assert text.endswith("use a smaller --capacity")


def test_cgroup_v1_hierarchical_limit(tmp_path: Path) -> None:
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    meminfo(proc, 64 << 20)
    write(proc / "self" / "cgroup", "5:cpu,cpuacct:/x\n4:memory:/job\n0::/\n")
    job = cgroups / "memory" / "job"
    write(job / "memory.limit_in_bytes", "9223372036854771712\n")  # unlimited itself
    write(job / "memory.usage_in_bytes", f"{3 * GiB}\n")
    stat = f"total_inactive_file {1 * GiB}\nhierarchical_memory_limit {4 * GiB}\n"
    write(job / "memory.stat", stat)
    memory = read_host_memory(proc=str(proc), cgroup_mount=str(cgroups))
    assert memory == HostMemory(mem_available=64 * GiB, cgroup_limit=4 * GiB, cgroup_room=2 * GiB)


def test_unlimited_cgroups_and_missing_files_leave_meminfo(tmp_path: Path) -> None:
    proc, cgroups = tmp_path / "proc", tmp_path / "cgroup"
    meminfo(proc, 1 << 20)
    write(proc / "self" / "cgroup", "4:memory:/gone\n0::/also-gone\n")
    write(cgroups / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")
    memory = read_host_memory(proc=str(proc), cgroup_mount=str(cgroups))
    assert memory == HostMemory(mem_available=GiB, cgroup_limit=None, cgroup_room=None)


def test_nothing_readable_checks_nothing(tmp_path: Path) -> None:
    memory = read_host_memory(proc=str(tmp_path / "none"), cgroup_mount=str(tmp_path / "none"))
    assert memory.available is None
    check_capacity(1 << 50, "1PiB", memory)  # no figure to compare with: not refused


def test_this_machine_has_a_figure() -> None:
    memory = read_host_memory()
    assert memory.mem_available is not None and memory.mem_available > 0
