"""The suite's /dev/shm leak check itself (conftest, Note [shm leak check]): what another program
leaves in /dev/shm does not fail a test, and a leak that jaxtransport or the test could have
made still does."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from .conftest import OWN_SHM_PREFIXES, SHM, shm_entries, shm_leaks

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM), reason="no /dev/shm on this system")

# A process outside the test (its own session, gone before the check) makes what a joblib job
# and some other program leave in /dev/shm while a test runs.
OUTSIDER = textwrap.dedent("""
    import os, sys
    pid = os.getpid()
    folder = os.path.join(sys.argv[1], f"joblib_memmapping_folder_{pid}_0123456789abcdef_x")
    os.mkdir(folder)
    with open(os.path.join(folder, "x.pkl"), "wb") as f:
        f.write(b"x" * 4096)
    with open(os.path.join(sys.argv[1], f"someone-elses-segment-{pid}"), "wb") as f:
        f.write(b"y" * 4096)
    print(os.path.basename(folder), f"someone-elses-segment-{pid}")
""")


def _remove(name: str) -> None:
    path = os.path.join(SHM, name)
    if os.path.isdir(path):
        for entry in os.listdir(path):
            os.unlink(os.path.join(path, entry))
        os.rmdir(path)
    elif os.path.lexists(path):
        os.unlink(path)


@pytest.fixture(scope="module")
def outsiders():
    """Entries made by another program, removed only after the module's tests: the autouse leak
    check of each test below runs while they are there."""
    made: list[str] = []
    yield made
    for name in made:
        _remove(name)


def _outsider_makes_entries() -> list[str]:
    proc = subprocess.run(
        [sys.executable, "-c", OUTSIDER, SHM], capture_output=True, text=True, timeout=60, start_new_session=True
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_entries_another_program_makes_during_a_test_are_not_a_leak(outsiders):
    before = shm_entries()
    names = _outsider_makes_entries()
    outsiders.extend(names)
    assert set(names) <= shm_entries() - before  # they are new since the test started...
    assert not shm_leaks(before, shm_entries())  # ...and the check ignores them
    # (and the autouse leak check after this test, with them still there, passes)


def test_a_leak_jaxtransport_could_make_is_caught():
    before = shm_entries()
    name = f"{OWN_SHM_PREFIXES[0]}-leak-check-{os.getpid()}"
    fd = os.open(os.path.join(SHM, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 4096)
        assert shm_leaks(before, shm_entries()) == {name}
    finally:
        os.close(fd)
        _remove(name)
    assert not shm_leaks(before, shm_entries())


def test_a_leak_of_a_library_the_test_drives_is_caught_by_its_pid():
    # A joblib memmapping folder carrying this process's pid (or a live child's) is the test's.
    before = shm_entries()
    name = f"joblib_memmapping_folder_{os.getpid()}_0123456789abcdef_leak"
    os.mkdir(os.path.join(SHM, name))
    try:
        assert shm_leaks(before, shm_entries()) == {name}
    finally:
        _remove(name)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        mine = f"pym-{child.pid}-abcdefgh"
        assert shm_leaks(set(), {mine, "pym-1-abcdefgh"}) == {mine}  # pid 1 is never the test's
    finally:
        child.communicate(b"", timeout=60)


def test_the_checker_by_names():
    me = os.getpid()
    after = {
        f"{OWN_SHM_PREFIXES[0]}_seg_123",  # jaxtransport's, whoever made it
        f"joblib_memmapping_folder_{me}_abc_def",  # the test process's joblib job
        "joblib_memmapping_folder_1_abc_def",  # another program's
        "psm_deadbeef",  # multiprocessing.shared_memory of another program
        "someone-elses-segment",
    }
    assert shm_leaks(set(), after, me) == {f"{OWN_SHM_PREFIXES[0]}_seg_123", f"joblib_memmapping_folder_{me}_abc_def"}
    assert shm_leaks(after, after, me) == set()  # only new entries count


def test_each_file_is_one_xdist_group(request):
    """Note [parallel test processes]: under ``--dist loadgroup`` (the make targets) every test
    of a file runs in one test process, one after another. pytest-xdist says so by the group's
    name after an ``@`` in the node id; pytest 9.2 ignores the id pytest-xdist 3.8.0 writes,
    and the groups then silently fall apart (.ci/tools.txt)."""
    if getattr(request.config, "workerinput", None) is None or not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not run by the make targets' test processes (pytest-xdist, --dist loadgroup)")
    assert request.node.nodeid.endswith("@" + request.node.path.name), (
        f"{request.node.nodeid}: its file is not an xdist group; is pytest newer than pytest-xdist "
        "supports (.ci/tools.txt)?"
    )
