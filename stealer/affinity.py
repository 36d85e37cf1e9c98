"""CPU topology, pinning policies and BLAS/OpenMP thread limits for stealer workers.

Two layers, kept apart so that the policies can be tested on fake machines:

* **OS layer** -- :func:`read_topology` reads sysfs, the cgroup filesystem and the process's
  CPU affinity and returns an immutable :class:`Topology`; :func:`pin_current_process` and
  :func:`apply_thread_limits` change the calling process.
* **Policy layer** -- :func:`plan`, :func:`steal_order` and :func:`describe` are pure
  functions of a :class:`Topology` value (plus their arguments).  They never touch the OS,
  except that :func:`plan` reads the machine's topology when none is given.

Where the topology comes from (Linux; every file is optional, and a missing, unreadable or
malformed file means "no information", never an error):

* ``devices/system/cpu/online`` -- the online CPUs (fallback: the ``cpuN`` directories, then
  the allowed set);
* ``cpuN/topology/core_cpus_list`` (older kernels: ``thread_siblings_list``) -- SMT siblings;
  fallback: each CPU is its own physical core;
* ``cpuN/topology/physical_package_id`` (fallback: ``package_cpus_list`` /
  ``core_siblings_list``) -- the socket; fallback: package 0;
* ``devices/system/node/nodeK/cpulist`` -- NUMA nodes; fallback: node 0;
* the allowed CPUs are ``os.sched_getaffinity(0)`` intersected with the cgroup cpuset
  (v2 ``cpuset.cpus.effective``, v1 ``cpuset/cpuset.effective_cpus``);
* the CPU quota is the smallest limit on the path from the process's own cgroup (found via
  ``/proc/self/cgroup`` when that path exists under the cgroup root) up to the root:
  v2 ``cpu.max``, v1 ``cpu/cpu.cfs_quota_us`` / ``cpu.cfs_period_us``.

Policies (:func:`plan`):

* ``"compact"`` -- fill the SMT siblings of one core, then the next core of the same
  package/NUMA node, then the next package (neighbouring workers share caches);
* ``"scatter"`` -- round-robin over packages (then NUMA nodes, then cores), one thread per
  physical core first, SMT siblings last (most memory bandwidth and cache per worker);
* ``"physical"`` -- exactly one worker per physical core (first sibling); too many workers
  is an error rather than a silent SMT share;
* an explicit sequence of CPU ids, one per worker;
* ``"none"`` / ``None`` -- no pinning.

``reserve_client=True`` keeps the last physical core of the chosen order (all its siblings)
free for the client process.  Compact and scatter wrap around with a :class:`RuntimeWarning`
when there are more workers than usable CPUs (allowed CPUs, cgroup quota, reserved core).

Used by the executor (stealer/client/executor.py: ``cpus=`` planned with :func:`plan` and
:func:`steal_order`), each worker process (stealer/worker/loop.py pins itself and sets its
thread limits), ``stealer topo`` (stealer/cli.py), ``stealer tune`` and stealer.joblib
(``n_jobs=-1``: the usable CPUs).
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property

from .errors import AffinityError

__all__ = [
    "CPU",
    "POLICIES",
    "THREAD_ENV_VARS",
    "Topology",
    "apply_thread_limits",
    "describe",
    "format_cpulist",
    "parse_cpulist",
    "pin_current_process",
    "plan",
    "read_topology",
    "steal_order",
    "thread_limit_env",
]

#: Named policies accepted by :func:`plan` (besides ``None`` and an explicit CPU list).
POLICIES: tuple[str, ...] = ("compact", "scatter", "physical", "none")

#: Environment variables that cap the thread pools of BLAS / OpenMP / numexpr libraries.
THREAD_ENV_VARS: tuple[str, ...] = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "BLIS_NUM_THREADS",
)

# Where the kernel lists the cgroups of this process (module-level so tests can redirect it).
_PROC_SELF_CGROUP = "/proc/self/cgroup"

_CPULIST_ITEM = re.compile(r"^(\d+)(?:-(\d+)(?::(\d+)/(\d+))?)?$")


# ---------------------------------------------------------------------------------------------
# CPU list syntax
# ---------------------------------------------------------------------------------------------


def parse_cpulist(text: str) -> list[int]:
    """Parse the kernel's CPU list syntax (``"0-3,8-11,13"``) into a sorted list of ids.

    Whitespace and empty items are ignored (``""`` and ``"\\n"`` give ``[]``); duplicates are
    merged.  The kernel's grouped form ``"0-15:2/4"`` (in each group of 4 starting at 0, the
    first 2) is accepted too.  Malformed text raises :class:`AffinityError`.
    """
    if not isinstance(text, str):
        raise AffinityError(f"a CPU list must be a string, not {type(text).__name__}")
    cpus: set[int] = set()
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        match = _CPULIST_ITEM.match(item)
        if match is None:
            raise AffinityError(f"invalid CPU list {text!r}: cannot parse {item!r}")
        first = int(match[1])
        last = int(match[2]) if match[2] is not None else first
        if last < first:
            raise AffinityError(f"invalid CPU list {text!r}: range {item!r} is reversed")
        used, group = 1, 1
        if match[3] is not None:
            used, group = int(match[3]), int(match[4])
            if not 1 <= used <= group:
                raise AffinityError(f"invalid CPU list {text!r}: bad group in {item!r}")
        for start in range(first, last + 1, group):
            cpus.update(range(start, min(start + used, last + 1)))
    return sorted(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """Format CPU ids in the kernel's compact syntax: ``[0, 1, 2, 3, 8, 13]`` -> ``"0-3,8,13"``."""
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


# ---------------------------------------------------------------------------------------------
# Topology value
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class CPU:
    """One logical CPU.

    ``core`` is a physical-core key that is unique across packages (SMT siblings share it);
    ``package`` is the socket; ``node`` the NUMA node (0 when unknown).
    """

    id: int
    core: int
    package: int = 0
    node: int = 0


@dataclass(frozen=True)
class Topology:
    """What this process may run on.  Immutable; build one by hand to model any machine.

    ``cpus`` holds only the CPUs this process may use (affinity ∩ cgroup cpuset), sorted by
    id; ``online`` all online CPUs of the machine; ``quota_cpus`` the cgroup CPU quota in
    CPUs (``None`` when unlimited).
    """

    cpus: tuple[CPU, ...]
    online: tuple[int, ...] = ()
    quota_cpus: float | None = None

    def __post_init__(self) -> None:
        cpus = tuple(sorted(self.cpus, key=lambda c: c.id))
        ids = [c.id for c in cpus]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate CPU ids in topology: {ids}")
        online = tuple(sorted(set(self.online))) if self.online else tuple(ids)
        quota = self.quota_cpus
        if quota is not None:
            quota = float(quota)
            if not quota > 0 or math.isinf(quota):
                raise ValueError(f"quota_cpus must be a positive number or None, not {quota!r}")
        object.__setattr__(self, "cpus", cpus)
        object.__setattr__(self, "online", online)
        object.__setattr__(self, "quota_cpus", quota)

    # -- derived views (cached; the value is immutable) -----------------------------------

    @cached_property
    def _by_id(self) -> dict[int, CPU]:
        return {c.id: c for c in self.cpus}

    @cached_property
    def _cores(self) -> tuple[tuple[CPU, ...], ...]:
        """Physical cores (sibling CPUs sorted by id), ordered by package, node, core."""
        groups: dict[tuple[int, int], list[CPU]] = {}
        for c in self.cpus:
            groups.setdefault((c.package, c.core), []).append(c)
        ordered = sorted(
            groups.values(),
            key=lambda g: (g[0].package, min(c.node for c in g), g[0].core, g[0].id),
        )
        return tuple(tuple(g) for g in ordered)

    @property
    def cpu_ids(self) -> tuple[int, ...]:
        """Ids of the usable CPUs, sorted."""
        return tuple(c.id for c in self.cpus)

    @property
    def packages(self) -> tuple[int, ...]:
        """Distinct package (socket) ids among the usable CPUs."""
        return tuple(sorted({c.package for c in self.cpus}))

    @property
    def nodes(self) -> tuple[int, ...]:
        """Distinct NUMA node ids among the usable CPUs."""
        return tuple(sorted({c.node for c in self.cpus}))

    def cpu(self, cpu: int) -> CPU:
        """The :class:`CPU` with id ``cpu``; :class:`AffinityError` if it is not usable."""
        try:
            return self._by_id[cpu]
        except (KeyError, TypeError):
            raise AffinityError(
                f"CPU {cpu!r} is not available to this process "
                f"(allowed CPUs: {format_cpulist(self.cpu_ids) or 'none'})"
            ) from None

    def siblings(self, cpu: int) -> tuple[int, ...]:
        """The usable SMT siblings of ``cpu``, itself included, sorted by id."""
        info = self.cpu(cpu)
        for core in self._cores:
            if core[0].package == info.package and core[0].core == info.core:
                return tuple(c.id for c in core)
        raise AssertionError("unreachable: every CPU belongs to a core")  # pragma: no cover

    def physical_cores(self) -> list[tuple[int, ...]]:
        """Usable CPUs grouped by physical core, in compact order (package, node, core)."""
        return [tuple(c.id for c in core) for core in self._cores]

    @property
    def usable_count(self) -> int:
        """How many CPUs' worth of work can run at once: ``min(len(cpus), ceil(quota))``."""
        if self.quota_cpus is None:
            return len(self.cpus)
        return min(len(self.cpus), max(1, math.ceil(self.quota_cpus - 1e-9)))


# ---------------------------------------------------------------------------------------------
# OS layer: reading the machine
# ---------------------------------------------------------------------------------------------


def _read_text(path: str) -> str | None:
    """The file's text, or ``None`` when it is missing or unreadable."""
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except (OSError, UnicodeDecodeError, ValueError):
        return None


def _read_cpulist_file(path: str) -> list[int] | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return parse_cpulist(text)
    except AffinityError:
        return None


def _read_int_file(path: str) -> int | None:
    text = _read_text(path)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        return None


def _current_affinity() -> set[int]:
    """The CPUs the calling process may run on."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    if getaffinity is not None:
        try:
            return set(getaffinity(0))
        except OSError:
            pass
    try:
        import psutil

        return set(psutil.Process().cpu_affinity())
    except Exception:  # psutil missing, or no cpu_affinity on this platform
        return set(range(os.cpu_count() or 1))


def _read_online(cpu_dir: str) -> list[int] | None:
    online = _read_cpulist_file(os.path.join(cpu_dir, "online"))
    if online:
        return online
    try:
        names = os.listdir(cpu_dir)
    except OSError:
        return None
    found = []
    for name in names:
        match = re.fullmatch(r"cpu(\d+)", name)
        if match is None:
            continue
        # cpu0 usually has no "online" file (it cannot be offlined): treat missing as online.
        if _read_int_file(os.path.join(cpu_dir, name, "online")) == 0:
            continue
        found.append(int(match[1]))
    return sorted(found) or None


def _read_numa_nodes(sysfs_root: str) -> dict[int, int]:
    """Map cpu id -> NUMA node id from ``devices/system/node/node*/cpulist``."""
    node_dir = os.path.join(sysfs_root, "devices", "system", "node")
    try:
        names = os.listdir(node_dir)
    except OSError:
        return {}
    cpu_node: dict[int, int] = {}
    for name in sorted(names):
        match = re.fullmatch(r"node(\d+)", name)
        if match is None:
            continue
        for cpu in _read_cpulist_file(os.path.join(node_dir, name, "cpulist")) or ():
            cpu_node.setdefault(cpu, int(match[1]))
    return cpu_node


def _read_cpu_layout(cpu_dir: str, cpus: Iterable[int]) -> dict[int, tuple[int, int]]:
    """Map cpu id -> (core key, package id) from ``cpuN/topology``, with fallbacks."""
    core_keys: dict[frozenset[int], int] = {}
    package_keys: dict[frozenset[int], int] = {}
    layout: dict[int, tuple[int, int]] = {}
    for cpu in sorted(set(cpus)):
        topo = os.path.join(cpu_dir, f"cpu{cpu}", "topology")
        siblings = _read_cpulist_file(os.path.join(topo, "core_cpus_list"))
        if not siblings:
            siblings = _read_cpulist_file(os.path.join(topo, "thread_siblings_list"))
        core_key = frozenset(siblings or ()) | {cpu}
        core = core_keys.setdefault(core_key, len(core_keys))

        package = _read_int_file(os.path.join(topo, "physical_package_id"))
        if package is None or package < 0:
            members = _read_cpulist_file(os.path.join(topo, "package_cpus_list"))
            if not members:
                members = _read_cpulist_file(os.path.join(topo, "core_siblings_list"))
            if members:
                package = package_keys.setdefault(frozenset(members) | {cpu}, len(package_keys))
            else:
                package = 0
        layout[cpu] = (core, package)
    return layout


def _parse_proc_cgroup(text: str) -> dict[str, str]:
    """Map controller -> cgroup path from ``/proc/self/cgroup`` (``""`` is the v2 hierarchy)."""
    paths: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            paths.setdefault("", path)
        for controller in controllers.split(","):
            if controller and not controller.startswith("name="):
                paths.setdefault(controller, path)
    return paths


def _cgroup_dirs(base: str, rel: str | None) -> list[str]:
    """Directories from the process's own cgroup (when it exists under ``base``) up to ``base``.

    In a container the cgroup root is usually the container's own cgroup and the path from
    ``/proc/self/cgroup`` does not exist under it; then only ``base`` is read.
    """
    parts = [p for p in (rel or "").split("/") if p and p not in (".", "..")]
    if parts and os.path.isdir(os.path.join(base, *parts)):
        return [os.path.join(base, *parts[:k]) for k in range(len(parts), 0, -1)] + [base]
    return [base]


def _parse_cpu_max(text: str | None) -> float | None:
    """cgroup v2 ``cpu.max`` ("200000 100000" -> 2.0, "max 100000" -> None)."""
    if text is None:
        return None
    fields = text.split()
    if not fields or fields[0] == "max":
        return None
    try:
        quota = int(fields[0])
        period = int(fields[1]) if len(fields) > 1 else 100_000
    except ValueError:
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period


def _read_cgroup(cgroup_root: str, proc_cgroup: str) -> tuple[float | None, set[int] | None]:
    """(CPU quota in CPUs or None, cgroup cpuset or None) for this process."""
    memberships = _parse_proc_cgroup(_read_text(proc_cgroup) or "")
    quotas: list[float] = []
    cpusets: list[set[int]] = []

    # cgroup v2 (unified hierarchy mounted at cgroup_root).
    v2_cpuset: list[int] | None = None
    for d in _cgroup_dirs(cgroup_root, memberships.get("")):
        quota = _parse_cpu_max(_read_text(os.path.join(d, "cpu.max")))
        if quota is not None:
            quotas.append(quota)
        if v2_cpuset is None:
            v2_cpuset = _read_cpulist_file(os.path.join(d, "cpuset.cpus.effective")) or None
    if v2_cpuset:
        cpusets.append(set(v2_cpuset))

    # cgroup v1: one directory per controller (or per co-mounted set of controllers).
    for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        base = os.path.join(cgroup_root, name)
        if not os.path.isdir(base):
            continue
        for d in _cgroup_dirs(base, memberships.get("cpu")):
            quota_us = _read_int_file(os.path.join(d, "cpu.cfs_quota_us"))
            period_us = _read_int_file(os.path.join(d, "cpu.cfs_period_us"))
            if quota_us is not None and period_us and quota_us > 0 and period_us > 0:
                quotas.append(quota_us / period_us)
        break
    base = os.path.join(cgroup_root, "cpuset")
    if os.path.isdir(base):
        for d in _cgroup_dirs(base, memberships.get("cpuset")):
            found = _read_cpulist_file(os.path.join(d, "cpuset.effective_cpus"))
            found = found or _read_cpulist_file(os.path.join(d, "cpuset.cpus"))
            if found:
                cpusets.append(set(found))
                break

    cpuset: set[int] | None = None
    for s in cpusets:
        cpuset = s if cpuset is None else cpuset & s
    return (min(quotas) if quotas else None), cpuset


def read_topology(
    sysfs_root: str = "/sys",
    cgroup_root: str = "/sys/fs/cgroup",
    allowed: Iterable[int] | None = None,
) -> Topology:
    """Read the machine's CPU topology and this process's CPU allowance.

    ``allowed`` defaults to ``os.sched_getaffinity(0)``.  The usable CPUs are ``allowed``
    intersected with the online CPUs and the cgroup cpuset (an intersection that comes out
    empty is treated as inconsistent information and ignored).  See the module docstring for
    the files read and their fallbacks.  Raises :class:`AffinityError` only when no CPU at
    all is allowed.
    """
    cpu_dir = os.path.join(sysfs_root, "devices", "system", "cpu")
    if allowed is None:
        allowed_set = _current_affinity()
    else:
        allowed_set = set()
        for cpu in allowed:
            if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 0:
                raise AffinityError(f"allowed CPUs must be non-negative ints, got {cpu!r}")
            allowed_set.add(cpu)
    if not allowed_set:
        raise AffinityError("no CPUs are allowed for this process")

    online = _read_online(cpu_dir) or sorted(allowed_set)
    quota, cpuset = _read_cgroup(cgroup_root, _PROC_SELF_CGROUP)

    usable = (allowed_set & set(online)) or allowed_set
    if cpuset is not None and usable & cpuset:
        usable &= cpuset

    layout = _read_cpu_layout(cpu_dir, set(online) | usable)
    nodes = _read_numa_nodes(sysfs_root)
    cpus = tuple(
        CPU(id=cpu, core=layout[cpu][0], package=layout[cpu][1], node=nodes.get(cpu, 0))
        for cpu in sorted(usable)
    )
    return Topology(cpus=cpus, online=tuple(sorted(set(online) | usable)), quota_cpus=quota)


# ---------------------------------------------------------------------------------------------
# Policy layer: pure functions of a Topology
# ---------------------------------------------------------------------------------------------


def _interleave(seqs: Sequence[Sequence[int]]) -> list[int]:
    """Round-robin merge: [[0, 1, 2], [4, 5]] -> [0, 4, 1, 5, 2]."""
    out: list[int] = []
    for k in range(max((len(s) for s in seqs), default=0)):
        out.extend(s[k] for s in seqs if k < len(s))
    return out


def _compact_order(topology: Topology) -> list[int]:
    return [cpu for core in topology.physical_cores() for cpu in core]


def _physical_order(topology: Topology) -> list[int]:
    return [core[0] for core in topology.physical_cores()]


def _scatter_order(topology: Topology) -> list[int]:
    """First thread of every core (round-robin packages, then nodes), then second threads..."""
    tree: dict[int, dict[int, list[tuple[int, ...]]]] = {}
    for core in topology.physical_cores():
        first = topology.cpu(core[0])
        tree.setdefault(first.package, {}).setdefault(first.node, []).append(core)
    depth = max((len(core) for core in topology.physical_cores()), default=0)
    order: list[int] = []
    for thread in range(depth):
        per_package = []
        for package in sorted(tree):
            per_node = [
                [core[thread] for core in tree[package][node] if len(core) > thread]
                for node in sorted(tree[package])
            ]
            per_package.append(_interleave(per_node))
        order.extend(_interleave(per_package))
    return order


_ORDERS = {"compact": _compact_order, "scatter": _scatter_order, "physical": _physical_order}


def _reserve_last_core(order: list[int], topology: Topology) -> tuple[list[int], tuple[int, ...]]:
    """Drop the physical core that comes last in ``order`` (all its siblings)."""
    cores_seen: list[tuple[int, ...]] = []
    for cpu in order:
        core = topology.siblings(cpu)
        if core not in cores_seen:
            cores_seen.append(core)
    if len(cores_seen) < 2:
        return order, ()
    reserved = cores_seen[-1]
    return [cpu for cpu in order if cpu not in reserved], reserved


def _check_n_workers(n_workers: int) -> None:
    if isinstance(n_workers, bool) or not isinstance(n_workers, int):
        raise AffinityError(f"n_workers must be an int, not {type(n_workers).__name__}")
    if n_workers < 1:
        raise AffinityError(f"n_workers must be at least 1, got {n_workers}")


def _explicit_plan(n_workers: int, cpus: list[object], topology: Topology) -> list[int | None]:
    not_ints = [c for c in cpus if isinstance(c, bool) or not isinstance(c, int)]
    if not_ints:
        raise AffinityError(f"an explicit CPU list must hold ints; got {not_ints!r}")
    allowed = set(topology.cpu_ids)
    bad = sorted({c for c in cpus if c not in allowed})  # type: ignore[misc]
    if bad:
        raise AffinityError(
            f"CPU(s) {', '.join(map(str, bad))} are not available to this process; "
            f"allowed CPUs: {format_cpulist(allowed) or 'none'}"
        )
    duplicates = sorted({c for c in cpus if cpus.count(c) > 1})  # type: ignore[misc]
    if duplicates:
        raise AffinityError(
            f"CPU(s) {', '.join(map(str, duplicates))} appear more than once in the explicit "
            "CPU list; give each worker its own CPU (or use policy='compact' to share)"
        )
    if len(cpus) < n_workers:
        raise AffinityError(
            f"the explicit CPU list has {len(cpus)} CPU(s) for {n_workers} workers; "
            "give one CPU per worker"
        )
    return list(cpus[:n_workers])  # type: ignore[arg-type]


def plan(
    n_workers: int,
    policy: str | Sequence[int] | None = "compact",
    topology: Topology | None = None,
    reserve_client: bool = False,
) -> list[int | None]:
    """The CPU for each of ``n_workers`` workers (``None`` = not pinned).

    ``policy`` is ``"compact"``, ``"scatter"``, ``"physical"``, ``"none"``/``None`` or an
    explicit sequence of CPU ids (all usable, no duplicates, at least ``n_workers`` long; its
    first ``n_workers`` are used).  ``topology`` defaults to :func:`read_topology`.
    ``reserve_client`` leaves the last physical core of the chosen order to the client
    (when there is more than one core; ignored for explicit lists and ``"none"``).

    Raises :class:`AffinityError` for invalid requests.  Compact and scatter wrap around
    with a :class:`RuntimeWarning` when there are more workers than usable CPUs.
    """
    _check_n_workers(n_workers)
    if policy is None or (isinstance(policy, str) and policy.strip().lower() == "none"):
        return [None] * n_workers

    if isinstance(policy, str):
        name = policy.strip().lower()
        if name not in _ORDERS:
            raise AffinityError(
                f"unknown affinity policy {policy!r}; valid policies are "
                f"{', '.join(repr(p) for p in POLICIES)}, None, or a list of CPU ids"
            )
        topo = topology if topology is not None else read_topology()
        if not topo.cpus:
            raise AffinityError("the topology has no usable CPUs")
        order = _ORDERS[name](topo)
        reserved: tuple[int, ...] = ()
        if reserve_client:
            order, reserved = _reserve_last_core(order, topo)
        note = f" (core {format_cpulist(reserved)} is reserved for the client)" if reserved else ""

        if name == "physical":
            if n_workers > len(order):
                raise AffinityError(
                    f"policy 'physical' puts one worker on each physical core, but only "
                    f"{len(order)} physical core(s) are available{note} for {n_workers} "
                    f"workers; use policy='compact' to share SMT siblings, or at most "
                    f"{len(order)} workers"
                )
            return list(order[:n_workers])

        capacity = len(order)
        limit = f"{capacity} usable CPU(s) {format_cpulist(order)}{note}"
        if topo.quota_cpus is not None:
            quota_capacity = max(1, topo.usable_count - len(reserved))
            if quota_capacity < capacity:
                capacity = quota_capacity
                limit = f"a cgroup CPU quota of {topo.quota_cpus:g} CPUs{note}"
        if n_workers > capacity:
            warnings.warn(
                f"oversubscription: {n_workers} workers with policy {name!r} on {limit}; "
                f"workers will share CPUs, which adds context switches and tail latency. "
                f"Use at most {capacity} workers.",
                RuntimeWarning,
                stacklevel=2,
            )
        return [order[i % len(order)] for i in range(n_workers)]

    if isinstance(policy, (bytes, bytearray)) or not isinstance(policy, Iterable):
        raise AffinityError(
            f"policy must be one of {', '.join(repr(p) for p in POLICIES)}, None, "
            f"or a list of CPU ids; got {policy!r}"
        )
    topo = topology if topology is not None else read_topology()
    return _explicit_plan(n_workers, list(policy), topo)


def steal_order(worker_cpus: Sequence[int | None], topology: Topology) -> list[list[int]]:
    """For each worker, the other workers' indices in the order it should try to steal.

    Closest first: workers on an SMT sibling (or the same CPU), then on the same NUMA node,
    then the same package, then the rest.  Ties keep a rotation that starts at ``i + 1`` so
    that thieves do not all hammer worker 0.  An unpinned worker (or one on a CPU the
    topology does not know) uses the plain rotation.
    """
    n = len(worker_cpus)
    infos = [topology._by_id.get(c) if c is not None else None for c in worker_cpus]
    result: list[list[int]] = []
    for i in range(n):
        rotation = [(i + k) % n for k in range(1, n)]
        me = infos[i]
        if me is None:
            result.append(rotation)
            continue

        def distance(j: int, me: CPU = me) -> int:
            other = infos[j]
            if other is None:
                return 3
            if other.package == me.package and other.core == me.core:
                return 0
            if other.node == me.node:
                return 1
            if other.package == me.package:
                return 2
            return 3

        result.append(sorted(rotation, key=distance))  # stable: rotation breaks ties
    return result


def describe(topology: Topology, n_workers: int | None = None) -> str:
    """Human-readable summary of ``topology`` and of what each policy would place.

    ``n_workers`` defaults to ``topology.usable_count``.
    """
    t = topology
    cores = t.physical_cores()
    max_smt = max((len(c) for c in cores), default=0)
    lines = [
        f"online CPUs   : {format_cpulist(t.online) or 'none'} ({len(t.online)})",
        f"allowed CPUs  : {format_cpulist(t.cpu_ids) or 'none'} ({len(t.cpus)})",
        "CPU quota     : "
        + ("unlimited" if t.quota_cpus is None else f"{t.quota_cpus:g} CPUs")
        + f" (usable CPUs: {t.usable_count})",
        f"packages      : {len(t.packages)} ({', '.join(map(str, t.packages))})",
        f"NUMA nodes    : {len(t.nodes)} ({', '.join(map(str, t.nodes))})",
        f"physical cores: {len(cores)}, up to {max_smt} SMT thread(s) each",
    ]
    groups: dict[tuple[int, int], list[tuple[int, ...]]] = {}
    for core in cores:
        first = t.cpu(core[0])
        groups.setdefault((first.package, first.node), []).append(core)
    for (package, node), members in groups.items():
        listed = " ".join("[" + ",".join(map(str, core)) + "]" for core in members)
        lines.append(f"  package {package}, node {node}: {listed}")

    n = n_workers if n_workers is not None else max(1, t.usable_count)
    lines.append(f"placement of {n} worker(s) by policy:")
    for name in POLICIES:
        label = f"  {name:<9}: "
        if name == "none":
            lines.append(label + "not pinned (each worker may run on any allowed CPU)")
            continue
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                cpus = plan(n, name, t)
        except AffinityError as exc:
            lines.append(label + f"not possible: {exc}")
            continue
        text = " ".join(f"w{i}->cpu{cpu}" for i, cpu in enumerate(cpus))
        if caught:
            text += "  [oversubscribed: workers share CPUs]"
        lines.append(label + text)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# OS layer: changing this process
# ---------------------------------------------------------------------------------------------


def pin_current_process(cpu: int | None) -> None:
    """Restrict the calling process to ``cpu`` (``None``: leave it as it is).

    Raises :class:`AffinityError` when the CPU does not exist, is not allowed (cgroup
    cpuset) or the platform cannot pin processes.
    """
    if cpu is None:
        return
    if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < 0:
        raise AffinityError(f"a CPU id must be a non-negative int, got {cpu!r}")
    setaffinity = getattr(os, "sched_setaffinity", None)
    if setaffinity is None:
        raise AffinityError("pinning to a CPU is not supported on this platform")
    try:
        setaffinity(0, {cpu})
    except (OSError, OverflowError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise AffinityError(
            f"cannot pin process {os.getpid()} to CPU {cpu}: {reason}; this process may use "
            f"CPUs {format_cpulist(_current_affinity()) or 'none'}"
        ) from exc


def thread_limit_env(n: int = 1) -> dict[str, str]:
    """Environment variables that cap BLAS/OpenMP/numexpr thread pools at ``n`` threads."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise AffinityError(f"thread limit must be an int >= 1, got {n!r}")
    return dict.fromkeys(THREAD_ENV_VARS, str(n))


def apply_thread_limits(n: int | None = 1) -> None:
    """Set :data:`THREAD_ENV_VARS` to ``n`` in ``os.environ``; ``None`` does nothing.

    Variables the user already set are left alone.  Call it before numpy/BLAS is imported
    (worker start-up): libraries read these variables when they load.
    """
    if n is None:
        return
    for key, value in thread_limit_env(n).items():
        os.environ.setdefault(key, value)
