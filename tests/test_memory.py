import collections

import pytest

from blockspec.training import memory
from blockspec.training.memory import available_memory, cgroup_memory_room

GiB = 2**30


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v1_tree(tmp_path, limit, usage, inactive):
    group = tmp_path / "cgroup" / "memory" / "pods" / "run"
    write(group / "memory.limit_in_bytes", f"{limit}\n")
    write(group / "memory.usage_in_bytes", f"{usage}\n")
    write(group / "memory.stat", f"cache 5\nhierarchical_memory_limit {limit}\ntotal_inactive_file {inactive}\n")
    write(tmp_path / "self_cgroup", "4:memory:/pods/run\n3:cpu,cpuacct:/pods/run\n0::/\n")
    return tmp_path / "cgroup", tmp_path / "self_cgroup"


def test_cgroup_v1_room_is_the_limit_less_the_usage_that_cannot_be_dropped(tmp_path):
    root, self_cgroup = v1_tree(tmp_path, limit=4 * GiB, usage=3 * GiB, inactive=GiB)
    assert cgroup_memory_room(root, self_cgroup) == 2 * GiB


def test_cgroup_v1_without_a_limit_has_no_room_to_report(tmp_path):
    root, self_cgroup = v1_tree(tmp_path, limit=9223372036854771712, usage=3 * GiB, inactive=0)
    assert cgroup_memory_room(root, self_cgroup) is None


def test_cgroup_v2_room_is_the_tightest_limit_of_the_group_and_its_parents(tmp_path):
    root = tmp_path / "cgroup"
    parent, group = root / "kubepods", root / "kubepods" / "pod1"
    write(parent / "memory.max", f"{8 * GiB}\n")
    write(parent / "memory.current", f"{5 * GiB}\n")
    write(parent / "memory.stat", f"anon 1\ninactive_file {GiB}\n")
    write(group / "memory.max", "max\n")
    write(group / "memory.current", f"{2 * GiB}\n")
    write(tmp_path / "self_cgroup", "0::/kubepods/pod1\n")
    assert cgroup_memory_room(root, tmp_path / "self_cgroup") == 4 * GiB
    write(group / "memory.max", f"{3 * GiB}\n")  # now the group's own limit is the tighter one
    assert cgroup_memory_room(root, tmp_path / "self_cgroup") == GiB


def test_inside_a_cgroup_namespace_the_mounted_root_is_the_group(tmp_path):
    root = tmp_path / "cgroup"
    write(root / "memory.max", f"{2 * GiB}\n")
    write(root / "memory.current", f"{GiB}\n")
    write(tmp_path / "self_cgroup", "0::/not/mounted/here\n")
    assert cgroup_memory_room(root, tmp_path / "self_cgroup") == GiB


@pytest.mark.parametrize("listing", [None, "", "0::/\n", "garbage\n"])
def test_no_readable_limit_means_no_room_to_report(tmp_path, listing):
    self_cgroup = tmp_path / "self_cgroup"
    if listing is not None:
        write(self_cgroup, listing)
    assert cgroup_memory_room(tmp_path / "cgroup", self_cgroup) is None


def test_available_memory_is_the_machines_capped_by_the_cgroup(tmp_path, monkeypatch):
    root, self_cgroup = v1_tree(tmp_path, limit=4 * GiB, usage=3 * GiB, inactive=GiB)
    machine = collections.namedtuple("machine", "available")
    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: machine(available=20 * GiB))
    assert available_memory(root, self_cgroup) == 2 * GiB
    monkeypatch.setattr(memory.psutil, "virtual_memory", lambda: machine(available=GiB))
    assert available_memory(root, self_cgroup) == GiB
    assert available_memory(tmp_path / "none", tmp_path / "none") == GiB


def test_this_machines_available_memory_is_positive():
    assert 0 < available_memory()
