"""Build fake sysfs and cgroup trees in a temporary directory for the affinity tests.

A machine is described as packages of physical cores of SMT sibling CPU ids::

    write_sysfs(tmp_path / "sys", [[(0, 8), (1, 9)], [(2, 10), (3, 11)]], nodes={...})

and written in the kernel's layout (``devices/system/cpu/cpuN/topology/...``,
``devices/system/node/nodeK/cpulist``), so :func:`stealer.affinity.read_topology` can read it
with ``sysfs_root=...``.  Options leave files out or use the older kernel file names, to
exercise the fallbacks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

__all__ = [
    "AMD_1S",
    "INTEL_2S",
    "INTEL_2S_NODES",
    "cpulist",
    "write_sysfs",
    "write_cgroup_v1",
    "write_cgroup_v2",
    "write_proc_cgroup",
    "intel_two_socket",
    "amd_one_socket",
]

Machine = Sequence[Sequence[Sequence[int]]]  # packages -> cores -> sibling cpu ids

#: 2 packages x 4 cores x 2 SMT threads, Intel-style numbering (cpu i and i+8 are siblings).
INTEL_2S: Machine = [
    [(0, 8), (1, 9), (2, 10), (3, 11)],
    [(4, 12), (5, 13), (6, 14), (7, 15)],
]
#: NUMA nodes of INTEL_2S: one per package.
INTEL_2S_NODES: Mapping[int, Sequence[int]] = {
    0: [0, 1, 2, 3, 8, 9, 10, 11],
    1: [4, 5, 6, 7, 12, 13, 14, 15],
}
#: 1 package x 4 cores x 2 SMT threads, AMD-style numbering (cpu 2k and 2k+1 are siblings).
AMD_1S: Machine = [[(0, 1), (2, 3), (4, 5), (6, 7)]]


def cpulist(cpus: Iterable[int]) -> str:
    """Kernel CPU list text for ``cpus`` (``[0, 1, 2, 5]`` -> ``"0-2,5"``)."""
    ids = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def write_sysfs(
    root: Path,
    packages: Machine,
    *,
    nodes: Mapping[int, Sequence[int]] | None = None,
    online: str | None = None,
    legacy_names: bool = False,
    topology_files: bool = True,
    package_id: bool = True,
    online_file: bool = True,
) -> Path:
    """Write a fake ``/sys`` for ``packages`` under ``root`` and return ``root``.

    ``nodes`` maps NUMA node id -> cpu ids (no ``devices/system/node`` when ``None``).
    ``online`` overrides the ``online`` file's text.  ``legacy_names`` writes only
    ``thread_siblings_list`` / ``core_siblings_list`` (pre-5.x kernels).  ``topology_files``
    False creates the ``cpuN`` directories without any ``topology`` files;
    ``package_id`` False omits ``physical_package_id``; ``online_file`` False omits
    ``devices/system/cpu/online``.
    """
    cpu_dir = root / "devices" / "system" / "cpu"
    all_cpus = sorted(c for package in packages for core in package for c in core)
    cpu_dir.mkdir(parents=True, exist_ok=True)
    if online_file:
        _write(cpu_dir / "online", online if online is not None else cpulist(all_cpus))
    for package_index, package in enumerate(packages):
        package_cpus = cpulist(c for core in package for c in core)
        for core in package:
            core_cpus = cpulist(core)
            for cpu in core:
                topo = cpu_dir / f"cpu{cpu}" / "topology"
                (cpu_dir / f"cpu{cpu}").mkdir(parents=True, exist_ok=True)
                if not topology_files:
                    continue
                if legacy_names:
                    _write(topo / "thread_siblings_list", core_cpus)
                    _write(topo / "core_siblings_list", package_cpus)
                else:
                    _write(topo / "core_cpus_list", core_cpus)
                    _write(topo / "thread_siblings_list", core_cpus)
                    _write(topo / "package_cpus_list", package_cpus)
                    _write(topo / "core_siblings_list", package_cpus)
                if package_id:
                    _write(topo / "physical_package_id", str(package_index))
    if nodes is not None:
        node_dir = root / "devices" / "system" / "node"
        for node, cpus in nodes.items():
            _write(node_dir / f"node{node}" / "cpulist", cpulist(cpus))
        _write(node_dir / "online", cpulist(nodes))
    return root


def write_cgroup_v2(
    root: Path,
    cpu_max: str | None = None,
    cpuset: str | None = None,
    subdir: str = "",
) -> Path:
    """Write a cgroup v2 directory (``root/subdir``) with ``cpu.max`` / ``cpuset.cpus.effective``.

    Returns the cgroup directory written.
    """
    d = root / subdir if subdir else root
    d.mkdir(parents=True, exist_ok=True)
    _write(root / "cgroup.controllers", "cpuset cpu io memory pids")
    if cpu_max is not None:
        _write(d / "cpu.max", cpu_max)
    if cpuset is not None:
        _write(d / "cpuset.cpus.effective", cpuset)
    return d


def write_cgroup_v1(
    root: Path,
    quota_us: int | None = None,
    period_us: int = 100_000,
    cpuset: str | None = None,
    controller_dir: str = "cpu",
    subdir: str = "",
) -> Path:
    """Write cgroup v1 ``cpu`` (``cpu.cfs_quota_us``, ``cpu.cfs_period_us``) and ``cpuset``."""
    d = root / controller_dir / subdir if subdir else root / controller_dir
    d.mkdir(parents=True, exist_ok=True)
    _write(d / "cpu.cfs_quota_us", str(quota_us if quota_us is not None else -1))
    _write(d / "cpu.cfs_period_us", str(period_us))
    if cpuset is not None:
        c = root / "cpuset" / subdir if subdir else root / "cpuset"
        _write(c / "cpuset.effective_cpus", cpuset)
    return d


def write_proc_cgroup(path: Path, lines: Sequence[str]) -> Path:
    """Write a fake ``/proc/self/cgroup`` file with ``lines``."""
    _write(path, "\n".join(lines))
    return path


def intel_two_socket(root: Path, **kwargs: object) -> Path:
    """Fake sysfs of machine (a): INTEL_2S with two NUMA nodes."""
    return write_sysfs(root, INTEL_2S, nodes=INTEL_2S_NODES, **kwargs)  # type: ignore[arg-type]


def amd_one_socket(root: Path, **kwargs: object) -> Path:
    """Fake sysfs of machine (b): AMD_1S, one NUMA node."""
    return write_sysfs(root, AMD_1S, nodes={0: range(8)}, **kwargs)  # type: ignore[arg-type]
