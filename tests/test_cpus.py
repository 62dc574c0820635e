"""CPU placement (``kvflow.cpus``): the CPUs a bound model thread leaves for kvflow's threads."""

from __future__ import annotations

import pathlib

import pytest

from kvflow.config import EngineConfig
from kvflow.cpus import _cpu_list_file, _spare, cpu_list, pin_current_thread, spare_cpus

# -- spare_cpus: the CPUs a bound model thread leaves for the copy threads -------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0-3,8", {0, 1, 2, 3, 8}), ("5", {5}), ("0-1\n", {0, 1}), ("", set()), ("x-1", set())],
)
def test_cpu_list_file(tmp_path: pathlib.Path, text: str, expected: set[int]) -> None:
    path = tmp_path / "cpus"
    path.write_text(text)

    assert _cpu_list_file(str(path)) == expected
    assert _cpu_list_file(str(tmp_path / "missing")) == set()


@pytest.mark.parametrize(
    ("allowed", "threads", "online", "cgroup", "nodes", "expected"),
    [
        # vLLM's CPU worker on 2 cores: its threads on core 0, core 1 reserved
        ({0, 1}, [{0}, {0}], {0, 1}, set(), [], (1,)),
        # one OpenMP thread per compute core: all of them kept off, the reserved ones left
        ({0, 1, 2, 3}, [{0}, {1}, {2}, {0}], {0, 1, 2, 3}, set(), [], (3,)),
        # nothing bound (a GPU worker): no pinning
        ({0, 1, 2, 3}, [{0, 1, 2, 3}], {0, 1, 2, 3}, set(), [], ()),
        # every CPU taken by the model: no pinning
        ({0, 1}, [{0}, {1}], {0, 1}, set(), [], ()),
        # a thread on a wider set than the server's own counts as unbound
        ({0, 1, 2}, [{0}, {0, 1, 2, 3}], {0, 1, 2, 3}, set(), [], (1, 2)),
        # the cgroup and the online CPUs limit the candidates
        ({0, 1, 2, 3}, [{0}], {0, 1, 2}, {0, 1}, [], (1,)),
        # only the NUMA node of the bound cores
        ({0, 1, 2, 3}, [{0}], {0, 1, 2, 3}, set(), [{0, 1}, {2, 3}], (1,)),
        ({0, 2, 3}, [{0}], {0, 1, 2, 3}, set(), [{0, 1}, {2, 3}], ()),
    ],
)
def test_spare(
    allowed: set[int],
    threads: list[set[int]],
    online: set[int],
    cgroup: set[int],
    nodes: list[set[int]],
    expected: tuple[int, ...],
) -> None:
    assert _spare(allowed, threads, online, cgroup, nodes) == expected


def test_spare_cpus_leave_out_a_bound_thread_of_this_process(bound_to_one_cpu: int) -> None:
    """The live reading: a thread of this process bound to one CPU, as vLLM binds its model
    thread; the spare CPUs never include it and are usable as copy_cpus."""
    bound = bound_to_one_cpu
    spare = spare_cpus()

    assert spare == tuple(sorted(spare))
    assert bound not in spare
    assert EngineConfig(copy_cpus=spare).copy_cpus == spare


def test_cpu_list_reads_a_command_line_s_list() -> None:
    import argparse

    assert cpu_list("0, 2,3") == (0, 2, 3)
    with pytest.raises(argparse.ArgumentTypeError, match="'0-3'"):
        cpu_list("0-3")


def test_pinning_nothing_is_refused_without_touching_the_thread() -> None:
    assert pin_current_thread(()) is False
