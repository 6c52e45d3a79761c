"""How much memory a run can still take: the machine's, or less under a container's limit.

``psutil`` reports the machine's available memory, which inside a container (a Kubernetes pod,
``docker run --memory``) can be far more than the container may use before it is killed. The
process's memory cgroup (v1 or v2) says the limit; page cache the cgroup can drop
(inactive files) counts as free, as the kernel reclaims it before killing.
"""

from __future__ import annotations

from pathlib import Path

import psutil

#: limits at or above this mean "no limit" (cgroup v1 writes about 2**63 for none)
UNLIMITED = 2**62


def available_memory(cgroup_root: Path = Path("/sys/fs/cgroup"), self_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """Bytes this process can still allocate: the machine's available memory, capped by its cgroup's room."""
    available = psutil.virtual_memory().available
    room = cgroup_memory_room(cgroup_root, self_cgroup)
    return available if room is None else min(available, room)


def cgroup_memory_room(cgroup_root: Path, self_cgroup: Path) -> int | None:
    """Bytes left under the memory limit of this process's cgroup and its ancestors; None without a limit."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    entries = [line.split(":", 2) for line in lines if line.count(":") >= 2]
    for _, controllers, path in entries:  # cgroup v1: a hierarchy of its own for the memory controller
        if "memory" in controllers.split(","):
            return _v1_room(_own_directory(cgroup_root / "memory", path))
    for hierarchy, controllers, path in entries:  # cgroup v2: one unified hierarchy
        if hierarchy == "0" and not controllers:
            return _v2_room(_own_directory(cgroup_root, path), cgroup_root)
    return None


def _own_directory(base: Path, path: str) -> Path:
    """The cgroup's directory; inside a cgroup namespace the listed path is not mounted, its root is the group."""
    directory = base / path.lstrip("/")
    return directory if directory.is_dir() else base


def _v1_room(directory: Path) -> int | None:
    stat = _read_stat(directory / "memory.stat")
    limit = stat.get("hierarchical_memory_limit") or _read_int(directory / "memory.limit_in_bytes")
    usage = _read_int(directory / "memory.usage_in_bytes")
    if limit is None or limit >= UNLIMITED or usage is None:
        return None
    return max(0, limit - usage + stat.get("total_inactive_file", stat.get("inactive_file", 0)))


def _v2_room(directory: Path, root: Path) -> int | None:
    rooms = []
    for group in [directory, *directory.parents]:
        if not group.is_relative_to(root):
            break
        limit = _read_limit(group / "memory.max")
        usage = _read_int(group / "memory.current")
        if limit is not None and usage is not None:
            rooms.append(max(0, limit - usage + _read_stat(group / "memory.stat").get("inactive_file", 0)))
    return min(rooms) if rooms else None


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    value = _parse_int(text)
    return None if value is None or value >= UNLIMITED else value


def _read_int(path: Path) -> int | None:
    try:
        return _parse_int(path.read_text().strip())
    except OSError:
        return None


def _read_stat(path: Path) -> dict[str, int]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    stat = {}
    for line in lines:
        key, _, value = line.partition(" ")
        if (number := _parse_int(value.strip())) is not None:
            stat[key] = number
    return stat


def _parse_int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None
