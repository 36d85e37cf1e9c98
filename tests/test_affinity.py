"""Tests for stealer.affinity: cpulist parsing, topology reading, policies, steal order, pinning.

Fake machines are written as sysfs/cgroup trees in tmp dirs (tests/fake_sysfs.py):
(a) 2 sockets x 4 cores x 2 SMT, 2 NUMA nodes, Intel numbering (cpu i and i+8 are siblings);
(b) 1 socket x 4 cores x 2 SMT, AMD numbering (0,1 siblings);
(c) machine (b) with a restricted allowed set and a cgroup v2 quota of 1.5 CPUs;
(d) missing topology files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from stealer import affinity
from stealer.affinity import (
    CPU,
    POLICIES,
    THREAD_ENV_VARS,
    Topology,
    apply_thread_limits,
    describe,
    format_cpulist,
    parse_cpulist,
    pin_current_process,
    plan,
    read_topology,
    steal_order,
    thread_limit_env,
)
from stealer.errors import AffinityError, StealerError

try:  # tests/ as a package, or tests/ itself on sys.path (pytest's default rootdir insertion)
    from tests import fake_sysfs
except ImportError:  # pragma: no cover - depends on how pytest was started
    import fake_sysfs  # type: ignore[no-redef]

REPO_ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _no_real_proc_cgroup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """Fake machines must not see this process's real /proc/self/cgroup."""
    fake = tmp_path / "proc_self_cgroup"
    monkeypatch.setattr(affinity, "_PROC_SELF_CGROUP", str(fake))
    return fake


def _read(tmp_path: Path, builder, allowed=None, **kwargs) -> Topology:
    sys_root = builder(tmp_path / "sys", **kwargs)
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir(exist_ok=True)
    if allowed is None:
        allowed = range(64)  # more than the machine has: read_topology clips to online
    return read_topology(str(sys_root), str(cgroup), allowed=allowed)


@pytest.fixture
def intel(tmp_path: Path) -> Topology:
    """Machine (a)."""
    return _read(tmp_path, fake_sysfs.intel_two_socket)


@pytest.fixture
def amd(tmp_path: Path) -> Topology:
    """Machine (b)."""
    return _read(tmp_path, fake_sysfs.amd_one_socket)


def _quiet_plan(*args, **kwargs):
    """plan() asserting that it emits no warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return plan(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# cpulist syntax
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", []),
        ("\n", []),
        ("0", [0]),
        ("7\n", [7]),
        ("0-3", [0, 1, 2, 3]),
        ("0-3,8-11,13", [0, 1, 2, 3, 8, 9, 10, 11, 13]),
        (" 1 , 3-4 \n", [1, 3, 4]),
        ("5,1-2,2,5", [1, 2, 5]),
        ("4-4", [4]),
        ("0,,2,", [0, 2]),
        ("0-9:2/5", [0, 1, 5, 6]),
        ("0-15:1/4", [0, 4, 8, 12]),
        ("100-102", [100, 101, 102]),
    ],
)
def test_parse_cpulist(text: str, expected: list[int]) -> None:
    assert parse_cpulist(text) == expected


@pytest.mark.parametrize("text", ["3-1", "a", "1-", "-1", "0-3:3/2", "0-3:0/2", "1 2", "0x3"])
def test_parse_cpulist_rejects_malformed(text: str) -> None:
    with pytest.raises(AffinityError, match="invalid CPU list"):
        parse_cpulist(text)


def test_parse_cpulist_rejects_non_string() -> None:
    with pytest.raises(AffinityError):
        parse_cpulist([0, 1])  # type: ignore[arg-type]


def test_format_cpulist_round_trip() -> None:
    assert format_cpulist([]) == ""
    assert format_cpulist([13, 0, 1, 2, 3, 8, 9, 10, 11, 2]) == "0-3,8-11,13"
    assert format_cpulist([5]) == "5"
    for text in ["0-3,8-11,13", "1,3,5", "0-63"]:
        assert format_cpulist(parse_cpulist(text)) == text


def test_affinity_error_is_value_error() -> None:
    assert issubclass(AffinityError, ValueError)
    assert issubclass(AffinityError, StealerError)


# ---------------------------------------------------------------------------------------------
# Topology value
# ---------------------------------------------------------------------------------------------


def test_topology_normalises_and_validates() -> None:
    t = Topology(cpus=(CPU(3, 1), CPU(1, 0)), quota_cpus=2)
    assert t.cpu_ids == (1, 3)
    assert t.online == (1, 3)
    assert t.quota_cpus == 2.0
    with pytest.raises(ValueError, match="duplicate"):
        Topology(cpus=(CPU(1, 0), CPU(1, 1)))
    with pytest.raises(ValueError, match="quota"):
        Topology(cpus=(CPU(0, 0),), quota_cpus=0)
    with pytest.raises(AffinityError, match="not available"):
        t.siblings(2)


def test_usable_count_rounds_quota_up_and_caps_at_cpus() -> None:
    cpus = tuple(CPU(i, i) for i in range(4))
    assert Topology(cpus).usable_count == 4
    assert Topology(cpus, quota_cpus=1.5).usable_count == 2
    assert Topology(cpus, quota_cpus=2.0).usable_count == 2
    assert Topology(cpus, quota_cpus=0.25).usable_count == 1
    assert Topology(cpus, quota_cpus=16).usable_count == 4


# ---------------------------------------------------------------------------------------------
# reading fake machines
# ---------------------------------------------------------------------------------------------


def test_read_two_socket_intel(intel: Topology) -> None:
    assert intel.cpu_ids == tuple(range(16))
    assert intel.online == tuple(range(16))
    assert intel.quota_cpus is None
    assert intel.usable_count == 16
    assert intel.packages == (0, 1)
    assert intel.nodes == (0, 1)
    assert intel.siblings(0) == (0, 8)
    assert intel.siblings(8) == (0, 8)
    assert intel.siblings(12) == (4, 12)
    assert intel.physical_cores() == [
        (0, 8), (1, 9), (2, 10), (3, 11), (4, 12), (5, 13), (6, 14), (7, 15),
    ]  # fmt: skip
    assert intel.cpu(3).package == 0 and intel.cpu(3).node == 0
    assert intel.cpu(13).package == 1 and intel.cpu(13).node == 1
    # core keys are unique across packages
    assert len({c.core for c in intel.cpus}) == 8


def test_read_one_socket_amd(amd: Topology) -> None:
    assert amd.cpu_ids == tuple(range(8))
    assert amd.packages == (0,)
    assert amd.nodes == (0,)
    assert amd.siblings(0) == (0, 1)
    assert amd.siblings(7) == (6, 7)
    assert amd.physical_cores() == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_restricted_allowed_set_and_cgroup_v2_quota(tmp_path: Path) -> None:
    """Machine (c): affinity 2-5 and cpu.max of 1.5 CPUs."""
    sys_root = fake_sysfs.amd_one_socket(tmp_path / "sys")
    cgroup = tmp_path / "cgroup"
    fake_sysfs.write_cgroup_v2(cgroup, cpu_max="150000 100000")
    t = read_topology(str(sys_root), str(cgroup), allowed=[5, 2, 3, 4])
    assert t.cpu_ids == (2, 3, 4, 5)
    assert t.online == tuple(range(8))
    assert t.quota_cpus == 1.5
    assert t.usable_count == 2
    assert t.siblings(2) == (2, 3)
    assert t.physical_cores() == [(2, 3), (4, 5)]
    assert _quiet_plan(2, "compact", t) == [2, 3]
    assert _quiet_plan(2, "scatter", t) == [2, 4]
    with pytest.warns(RuntimeWarning, match=r"quota of 1\.5 CPUs"):
        assert plan(3, "scatter", t) == [2, 4, 3]
    # the allowed set is respected by explicit lists too
    with pytest.raises(AffinityError, match=r"allowed CPUs: 2-5"):
        plan(2, [0, 2], t)


def test_cgroup_cpuset_narrows_affinity(tmp_path: Path) -> None:
    sys_root = fake_sysfs.amd_one_socket(tmp_path / "sys")
    cgroup = tmp_path / "cgroup"
    fake_sysfs.write_cgroup_v2(cgroup, cpu_max="max 100000", cpuset="0-4")
    t = read_topology(str(sys_root), str(cgroup), allowed=range(2, 8))
    assert t.cpu_ids == (2, 3, 4)
    assert t.quota_cpus is None


def test_cgroup_v2_own_cgroup_from_proc_takes_smallest_quota(
    tmp_path: Path, _no_real_proc_cgroup: Path
) -> None:
    sys_root = fake_sysfs.amd_one_socket(tmp_path / "sys")
    cgroup = tmp_path / "cgroup"
    fake_sysfs.write_cgroup_v2(cgroup, cpu_max="300000 100000")
    fake_sysfs.write_cgroup_v2(cgroup, cpu_max="50000 100000", subdir="app.slice/job")
    fake_sysfs.write_cgroup_v2(cgroup, cpu_max="max 100000", subdir="app.slice")
    # not in the cgroup (no /proc info): only the root's limit counts
    assert read_topology(str(sys_root), str(cgroup), allowed=range(8)).quota_cpus == 3.0
    fake_sysfs.write_proc_cgroup(_no_real_proc_cgroup, ["0::/app.slice/job"])
    t = read_topology(str(sys_root), str(cgroup), allowed=range(8))
    assert t.quota_cpus == 0.5
    assert t.usable_count == 1
    # a path that does not exist under the root (container without cgroupns) -> root only
    fake_sysfs.write_proc_cgroup(_no_real_proc_cgroup, ["0::/docker/abc123"])
    assert read_topology(str(sys_root), str(cgroup), allowed=range(8)).quota_cpus == 3.0


@pytest.mark.parametrize(
    ("quota_us", "period_us", "expected"),
    [(250_000, 100_000, 2.5), (-1, 100_000, None), (50_000, 0, None)],
)
def test_cgroup_v1_quota(tmp_path: Path, quota_us: int, period_us: int, expected) -> None:
    sys_root = fake_sysfs.amd_one_socket(tmp_path / "sys")
    cgroup = tmp_path / "cgroup"
    fake_sysfs.write_cgroup_v1(cgroup, quota_us=quota_us, period_us=period_us, cpuset="0-3")
    t = read_topology(str(sys_root), str(cgroup), allowed=range(8))
    assert t.quota_cpus == expected
    assert t.cpu_ids == (0, 1, 2, 3)


def test_cgroup_v1_own_cgroup(tmp_path: Path, _no_real_proc_cgroup: Path) -> None:
    sys_root = fake_sysfs.amd_one_socket(tmp_path / "sys")
    cgroup = tmp_path / "cgroup"
    fake_sysfs.write_cgroup_v1(cgroup, controller_dir="cpu,cpuacct")
    fake_sysfs.write_cgroup_v1(cgroup, 150_000, controller_dir="cpu,cpuacct", subdir="job")
    fake_sysfs.write_proc_cgroup(_no_real_proc_cgroup, ["4:cpu,cpuacct:/job", "1:name=x:/"])
    assert read_topology(str(sys_root), str(cgroup), allowed=range(8)).quota_cpus == 1.5


@pytest.mark.parametrize("cpu_max", ["max", "max 100000", "", "garbage here", "0 100000"])
def test_unlimited_or_malformed_cpu_max_means_no_quota(tmp_path: Path, cpu_max: str) -> None:
    sys_root = fake_sysfs.amd_one_socket(tmp_path / "sys")
    cgroup = tmp_path / "cgroup"
    fake_sysfs.write_cgroup_v2(cgroup, cpu_max=cpu_max)
    assert read_topology(str(sys_root), str(cgroup), allowed=range(8)).quota_cpus is None


def test_missing_topology_files_fall_back(tmp_path: Path) -> None:
    """Machine (d): cpuN dirs exist but no topology files and no NUMA directory."""
    t = _read(tmp_path, fake_sysfs.write_sysfs, packages=fake_sysfs.AMD_1S, topology_files=False)
    assert t.cpu_ids == tuple(range(8))
    assert {c.package for c in t.cpus} == {0}
    assert {c.node for c in t.cpus} == {0}
    assert len({c.core for c in t.cpus}) == 8  # each CPU its own core
    assert t.siblings(1) == (1,)
    assert _quiet_plan(8, "physical", t) == list(range(8))
    assert _quiet_plan(3, "scatter", t) == [0, 1, 2]


def test_legacy_file_names_and_no_package_id(tmp_path: Path) -> None:
    t = _read(tmp_path, fake_sysfs.intel_two_socket, legacy_names=True, package_id=False)
    assert t.siblings(9) == (1, 9)
    assert t.packages == (0, 1)
    assert t.cpu(0).package != t.cpu(4).package
    assert t.cpu(0).package == t.cpu(11).package


def test_missing_online_file_uses_cpu_dirs(tmp_path: Path) -> None:
    sys_root = fake_sysfs.amd_one_socket(tmp_path / "sys", online_file=False)
    cpu_dir = sys_root / "devices" / "system" / "cpu"
    (cpu_dir / "cpu7" / "online").write_text("0\n")  # offline
    (cpu_dir / "cpu6" / "online").write_text("1\n")
    t = read_topology(str(sys_root), str(tmp_path / "nocgroup"), allowed=range(16))
    assert t.online == tuple(range(7))
    assert t.cpu_ids == tuple(range(7))
    assert t.siblings(6) == (6,)  # its sibling 7 is offline


def test_empty_sysfs_uses_allowed_set(tmp_path: Path) -> None:
    t = read_topology(str(tmp_path / "nosys"), str(tmp_path / "nocgroup"), allowed=[1, 3])
    assert t.cpu_ids == (1, 3)
    assert t.online == (1, 3)
    assert t.physical_cores() == [(1,), (3,)]
    assert t.quota_cpus is None


def test_unreadable_garbage_files_mean_no_info(tmp_path: Path) -> None:
    sys_root = fake_sysfs.amd_one_socket(tmp_path / "sys")
    topo = sys_root / "devices" / "system" / "cpu" / "cpu0" / "topology"
    (topo / "core_cpus_list").write_text("not a list\n")
    (topo / "thread_siblings_list").write_bytes(b"\xff\xfe")
    (topo / "physical_package_id").write_text("x\n")
    t = read_topology(str(sys_root), str(tmp_path / "nocgroup"), allowed=range(8))
    assert t.siblings(0) == (0,)  # fell back to "its own core"
    assert t.siblings(1) == (1,)  # cpu1 reports {0,1}, a different core key than cpu0's
    assert t.cpu(0).package == 0


def test_read_topology_rejects_empty_or_bad_allowed(tmp_path: Path) -> None:
    sys_root = str(fake_sysfs.amd_one_socket(tmp_path / "sys"))
    with pytest.raises(AffinityError, match="no CPUs"):
        read_topology(sys_root, str(tmp_path), allowed=[])
    with pytest.raises(AffinityError):
        read_topology(sys_root, str(tmp_path), allowed=[-1])


# ---------------------------------------------------------------------------------------------
# policies
# ---------------------------------------------------------------------------------------------


def test_compact_on_intel(intel: Topology) -> None:
    assert _quiet_plan(16, "compact", intel) == [
        0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
    ]  # fmt: skip
    assert _quiet_plan(3, "compact", intel) == [0, 8, 1]
    assert _quiet_plan(10, " Compact ", intel) == [0, 8, 1, 9, 2, 10, 3, 11, 4, 12]


def test_scatter_on_intel(intel: Topology) -> None:
    assert _quiet_plan(16, "scatter", intel) == [
        0, 4, 1, 5, 2, 6, 3, 7, 8, 12, 9, 13, 10, 14, 11, 15,
    ]  # fmt: skip
    assert _quiet_plan(2, "scatter", intel) == [0, 4]


def test_physical_on_intel(intel: Topology) -> None:
    assert _quiet_plan(8, "physical", intel) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert _quiet_plan(3, "physical", intel) == [0, 1, 2]
    with pytest.raises(AffinityError, match=r"only 8 physical core.*'compact'"):
        plan(9, "physical", intel)


def test_policies_on_amd(amd: Topology) -> None:
    assert _quiet_plan(8, "compact", amd) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert _quiet_plan(8, "scatter", amd) == [0, 2, 4, 6, 1, 3, 5, 7]
    assert _quiet_plan(4, "physical", amd) == [0, 2, 4, 6]
    with pytest.raises(AffinityError, match="compact"):
        plan(5, "physical", amd)


def test_scatter_alternates_packages_with_uneven_allowed_set(tmp_path: Path) -> None:
    # package 0 keeps cores {0,8},{1,9},{2,10}; package 1 only cpu 4 (sibling 12 not allowed)
    t = _read(tmp_path, fake_sysfs.intel_two_socket, allowed=[0, 1, 2, 4, 8, 9, 10])
    assert _quiet_plan(7, "scatter", t) == [0, 4, 1, 2, 8, 9, 10]
    # SMT siblings strictly after every core's first thread
    assert _quiet_plan(7, "compact", t) == [0, 8, 1, 9, 2, 10, 4]


def test_none_policy_does_not_pin(intel: Topology) -> None:
    assert plan(3, None, intel) == [None, None, None]
    assert plan(2, "none", intel) == [None, None]
    assert plan(2, "NONE") == [None, None]  # no topology needed
    assert plan(20, "none", intel, reserve_client=True) == [None] * 20


def test_explicit_list(intel: Topology) -> None:
    assert plan(2, [3, 12], intel) == [3, 12]
    assert plan(2, (5, 1, 7), intel) == [5, 1]
    assert plan(3, range(3), intel) == [0, 1, 2]
    assert plan(2, [3, 12], intel, reserve_client=True) == [3, 12]


def test_explicit_list_errors(intel: Topology) -> None:
    with pytest.raises(AffinityError, match=r"CPU\(s\) 16, 99 are not available.*0-15"):
        plan(3, [1, 99, 16], intel)
    with pytest.raises(AffinityError, match=r"2 CPU\(s\) for 3 workers"):
        plan(3, [1, 2], intel)
    with pytest.raises(AffinityError, match="more than once"):
        plan(2, [1, 1], intel)
    with pytest.raises(AffinityError, match="ints"):
        plan(2, [1, "2"], intel)  # type: ignore[list-item]
    with pytest.raises(AffinityError, match="ints"):
        plan(1, [True], intel)
    with pytest.raises(AffinityError):
        plan(1, 3, intel)  # type: ignore[arg-type]


def test_invalid_policy_and_worker_count(intel: Topology) -> None:
    with pytest.raises(AffinityError) as info:
        plan(2, "spread", intel)
    for name in POLICIES:
        assert repr(name) in str(info.value)
    with pytest.raises(AffinityError, match="at least 1"):
        plan(0, "compact", intel)
    with pytest.raises(AffinityError, match="at least 1"):
        plan(-2, None)
    with pytest.raises(AffinityError, match="int"):
        plan(2.0, "compact", intel)  # type: ignore[arg-type]


def test_reserve_client_amd(amd: Topology) -> None:
    assert _quiet_plan(4, "compact", amd, reserve_client=True) == [0, 1, 2, 3]
    assert _quiet_plan(6, "compact", amd, reserve_client=True) == [0, 1, 2, 3, 4, 5]
    assert _quiet_plan(6, "scatter", amd, reserve_client=True) == [0, 2, 4, 1, 3, 5]
    assert _quiet_plan(3, "physical", amd, reserve_client=True) == [0, 2, 4]
    with pytest.raises(AffinityError, match="reserved for the client"):
        plan(4, "physical", amd, reserve_client=True)
    with pytest.warns(RuntimeWarning, match="reserved for the client"):
        assert plan(7, "compact", amd, reserve_client=True) == [0, 1, 2, 3, 4, 5, 0]


def test_reserve_client_intel_keeps_last_core_of_each_order(intel: Topology) -> None:
    compact = _quiet_plan(14, "compact", intel, reserve_client=True)
    assert 7 not in compact and 15 not in compact
    assert compact == [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14]
    scatter = _quiet_plan(14, "scatter", intel, reserve_client=True)
    assert scatter == [0, 4, 1, 5, 2, 6, 3, 8, 12, 9, 13, 10, 14, 11]


def test_reserve_client_needs_two_cores() -> None:
    one_core = Topology(cpus=(CPU(0, 0), CPU(1, 0)))
    assert _quiet_plan(2, "compact", one_core, reserve_client=True) == [0, 1]
    assert _quiet_plan(1, "physical", one_core, reserve_client=True) == [0]


def test_oversubscription_wraps_with_warning(amd: Topology) -> None:
    with pytest.warns(RuntimeWarning, match=r"oversubscription: 9 workers.*8 usable CPU"):
        assert plan(9, "compact", amd) == [0, 1, 2, 3, 4, 5, 6, 7, 0]
    with pytest.warns(RuntimeWarning, match="oversubscription"):
        assert plan(10, "scatter", amd) == [0, 2, 4, 6, 1, 3, 5, 7, 0, 2]


# ---------------------------------------------------------------------------------------------
# steal order
# ---------------------------------------------------------------------------------------------


def test_steal_order_prefers_smt_siblings(intel: Topology) -> None:
    cpus = _quiet_plan(4, "compact", intel)  # [0, 8, 1, 9]
    assert steal_order(cpus, intel) == [[1, 2, 3], [0, 2, 3], [3, 0, 1], [2, 0, 1]]


def test_steal_order_prefers_same_node(intel: Topology) -> None:
    cpus = _quiet_plan(4, "scatter", intel)  # [0, 4, 1, 5]: w0,w2 on node 0; w1,w3 on node 1
    assert steal_order(cpus, intel) == [[2, 1, 3], [3, 2, 0], [0, 3, 1], [1, 0, 2]]


def test_steal_order_siblings_then_node_then_package_then_rest() -> None:
    t = Topology(
        cpus=(
            CPU(0, core=0, package=0, node=0),
            CPU(1, core=0, package=0, node=0),  # SMT sibling of cpu 0
            CPU(2, core=1, package=0, node=0),  # same node
            CPU(3, core=2, package=0, node=1),  # same package, other node (sub-NUMA)
            CPU(4, core=3, package=1, node=2),  # other package
        )
    )
    workers = [4, 3, 2, 1, 0]
    order = steal_order(workers, t)
    assert order[4] == [3, 2, 1, 0]  # cpu0: sibling w3, node w2, package w1, rest w0
    assert order[0] == [1, 2, 3, 4]  # cpu4: all "rest", plain rotation from 1
    assert order[2] == [3, 4, 1, 0]  # cpu2: node {w3,w4} in rotation, package w1, rest w0


def test_steal_order_unpinned_and_shared_cpus(intel: Topology) -> None:
    assert steal_order([None, None, None], intel) == [[1, 2], [2, 0], [0, 1]]
    assert steal_order([0], intel) == [[]]
    assert steal_order([], intel) == []
    # an unpinned peer sorts last; two workers on one CPU are each other's closest
    assert steal_order([0, None, 4, 0], intel) == [[3, 1, 2], [2, 3, 0], [3, 0, 1], [0, 1, 2]]


def test_every_worker_gets_a_permutation_of_the_others(intel: Topology) -> None:
    for policy in ("compact", "scatter", "physical"):
        cpus = _quiet_plan(8, policy, intel)
        for i, others in enumerate(steal_order(cpus, intel)):
            assert sorted(others) == [j for j in range(8) if j != i]


# ---------------------------------------------------------------------------------------------
# describe
# ---------------------------------------------------------------------------------------------


def test_describe_lists_topology_and_every_policy(intel: Topology) -> None:
    text = describe(intel)
    assert "allowed CPUs  : 0-15 (16)" in text
    assert "packages      : 2" in text
    assert "NUMA nodes    : 2" in text
    assert "[0,8] [1,9] [2,10] [3,11]" in text
    assert "unlimited" in text
    for name in POLICIES:
        assert f"  {name:<9}: " in text
    assert "compact  : w0->cpu0 w1->cpu8 w2->cpu1" in text
    assert "scatter  : w0->cpu0 w1->cpu4 w2->cpu1" in text
    assert "physical : not possible: " in text  # 16 workers on 8 cores


def test_describe_quota_and_oversubscription_without_warnings(tmp_path: Path) -> None:
    sys_root = fake_sysfs.amd_one_socket(tmp_path / "sys")
    cgroup = tmp_path / "cgroup"
    fake_sysfs.write_cgroup_v2(cgroup, cpu_max="150000 100000")
    t = read_topology(str(sys_root), str(cgroup), allowed=[2, 3, 4, 5])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text = describe(t)
        big = describe(t, n_workers=5)
    assert "1.5 CPUs" in text
    assert "placement of 2 worker(s)" in text
    assert "physical : w0->cpu2 w1->cpu4" in text
    assert "oversubscribed" not in text
    assert "oversubscribed" in big
    assert "physical : not possible: " in big


# ---------------------------------------------------------------------------------------------
# thread limits
# ---------------------------------------------------------------------------------------------


def test_thread_limit_env() -> None:
    env = thread_limit_env()
    assert set(env) == {
        "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
        "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS", "BLIS_NUM_THREADS",
    }  # fmt: skip
    assert set(env.values()) == {"1"}
    assert set(thread_limit_env(4).values()) == {"4"}
    with pytest.raises(AffinityError):
        thread_limit_env(0)


def test_apply_thread_limits_keeps_user_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in THREAD_ENV_VARS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    apply_thread_limits(None)
    assert "MKL_NUM_THREADS" not in os.environ
    apply_thread_limits()
    assert os.environ["OMP_NUM_THREADS"] == "3"
    for key in THREAD_ENV_VARS[1:]:
        assert os.environ[key] == "1"


# ---------------------------------------------------------------------------------------------
# this machine
# ---------------------------------------------------------------------------------------------

_needs_affinity = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity"), reason="needs os.sched_getaffinity (Linux)"
)


@_needs_affinity
def test_read_topology_on_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(affinity, "_PROC_SELF_CGROUP", "/proc/self/cgroup")
    allowed = sorted(os.sched_getaffinity(0))
    t = read_topology()
    assert list(t.cpu_ids) == allowed
    assert set(t.cpu_ids) <= set(t.online)
    assert 1 <= t.usable_count <= len(allowed)
    assert sorted(c for core in t.physical_cores() for c in core) == allowed
    cpus = _quiet_plan(t.usable_count, "compact")
    assert set(cpus) <= set(allowed)
    assert describe(t).count("->cpu") >= 2


@_needs_affinity
def test_pin_current_process_really_pins_in_a_child() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    target = allowed[-1]
    missing = max(allowed) + 4096  # not a CPU of this machine
    code = textwrap.dedent(
        f"""
        import json, os
        from stealer.affinity import pin_current_process
        from stealer.errors import AffinityError
        before = sorted(os.sched_getaffinity(0))
        pin_current_process(None)
        unchanged = sorted(os.sched_getaffinity(0))
        try:
            pin_current_process({missing})
            error = None
        except AffinityError as exc:
            error = str(exc)
        after_error = sorted(os.sched_getaffinity(0))
        pin_current_process({target})
        print(json.dumps([before, unchanged, error, after_error, sorted(os.sched_getaffinity(0))]))
        """
    )
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    before, unchanged, error, after_error, pinned = json.loads(proc.stdout.strip().splitlines()[-1])
    assert before == allowed
    assert unchanged == allowed
    assert error is not None and f"CPU {missing}" in error
    assert after_error == allowed
    assert pinned == [target]
    assert sorted(os.sched_getaffinity(0)) == allowed  # this test process was not pinned


def test_pin_current_process_validates_before_touching_the_os() -> None:
    pin_current_process(None)
    for bad in (-1, True, "0", 1.0):
        with pytest.raises(AffinityError):
            pin_current_process(bad)  # type: ignore[arg-type]
