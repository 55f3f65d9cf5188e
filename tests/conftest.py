"""For both scopes: random tiny models built once per session, the `slow` mark enforced, and
`tests/` on sys.path so that tests import their helpers as the `support` package.

tests/unit/ runs in process; tests/e2e/ starts processes (its conftest holds the session's shared
deployments). The transformers oracle is support/oracle.py."""

from __future__ import annotations

import multiprocessing.process
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
# The repository's top-level folders share names with installed packages (kernels/ is Hugging
# Face's `kernels`, which transformers imports): `python -m pytest` and xdist's workers put the
# working directory first on sys.path, and a test run from the root would import those folders.
# The installed pagedserve is what runs; every process a test starts inherits PYTHONSAFEPATH.
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != ROOT]
os.environ["PYTHONSAFEPATH"] = "1"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))  # `import support` under any --import-mode

# First, before any test module imports triton: the test device decides TRITON_INTERPRET, which
# triton reads when the kernels are decorated, whichever folder's module is collected first.
from support.kernel_device import DEVICE  # noqa: E402

# On the CPU test device tests/unit/ starts no process; on CUDA the Triton kernel tests there
# compile with ptxas, a process, and carry the slow mark (support/kernel_device.py).
UNIT_IN_PROCESS = DEVICE.type == "cpu"

# ---------------------------------------------------------------- the slow mark, enforced
# A test that starts a process (a deployment, LLM, a subprocess, multiprocessing) must be
# marked slow and live in tests/e2e/, so `pytest -m "not slow"` and `pytest tests/unit` stay the
# fast, single-process suite. Every start is recorded against the test being set up, run or torn
# down (fixtures of any scope included); the process still starts, so the test cleans up as
# usual, and then its report fails.

_running_item = None
_unmarked_starts: dict[str, str] = {}  # node id -> the first process it started


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _running_item
    _running_item = item
    try:
        yield
    finally:
        _running_item = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    started = _unmarked_starts.pop(item.nodeid, None)
    if started is not None and not report.failed:
        report.outcome = "failed"
        report.longrepr = (f"UnmarkedSlowTest: {item.nodeid} starts a process ({started}) but is not marked "
                           "slow in tests/e2e/; mark it @pytest.mark.slow and keep it there (docs/CONTRIBUTING.md)")


def _in_unit(item) -> bool:
    return UNIT_IN_PROCESS and (TESTS / "unit") in Path(item.path).parents


def _record_start(what: str) -> None:
    item = _running_item
    if item is not None and (item.get_closest_marker("slow") is None or _in_unit(item)):
        _unmarked_starts.setdefault(item.nodeid, what[:100])


def pytest_collection_modifyitems(config, items):
    """Every test lives in tests/unit/ (in process, never marked slow) or tests/e2e/; the unit
    tests run first, so a broken rule shows in seconds, before any deployment starts."""
    misplaced = [item.nodeid for item in items if _in_unit(item) and item.get_closest_marker("slow")]
    if misplaced:
        raise pytest.UsageError(f"tests marked slow start processes and belong in tests/e2e/: {misplaced}")
    loose = sorted({item.nodeid.split("::")[0] for item in items if Path(item.path).parent == TESTS})
    if loose:
        raise pytest.UsageError(f"move these into tests/unit/ (in process) or tests/e2e/ (starts processes): {loose}")
    # Stable: each scope keeps its order. Under xdist the Ray module, the longest (a cluster of
    # three nodes), starts first among e2e, so the other worker's files overlap it instead of
    # one worker running it alone at the end.
    items.sort(key=lambda item: ((TESTS / "unit") not in Path(item.path).parents,
                                 item.get_closest_marker("ray") is None))


_SHORT_BASETEMP = pytest.StashKey[str]()  # the base temp dir this controller made


def pytest_configure(config):
    # A deployment's ipc sockets live in its run dir, and an ipc path holds at most 107 bytes.
    # pytest's default base (/tmp/pytest-of-USER/pytest-N/), plus xdist's popen-gwN/ and a test's
    # own folder, left a run dir too little room ("ipc path ... is longer than 107 characters").
    # The xdist workers take theirs under the controller's (``workerinput``: a worker).
    if config.option.basetemp is None and not hasattr(config, "workerinput"):
        config.option.basetemp = tempfile.mkdtemp(prefix="pst-", dir="/tmp")
        config.stash[_SHORT_BASETEMP] = config.option.basetemp
    if hasattr(config, "workerinput"):
        # Each xdist worker computes in process on its share of the cores: with torch's default
        # (every core) two workers' OpenMP threads spun against each other.
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(config.workerinput.get("workercount", 1))))
    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def recorded_popen_init(self, args, *rest, **kwargs):
        _record_start(args if isinstance(args, str) else " ".join(map(str, args)))
        popen_init(self, args, *rest, **kwargs)

    def recorded_process_start(self):
        _record_start(f"multiprocessing {self.name}")
        process_start(self)

    subprocess.Popen.__init__ = recorded_popen_init
    multiprocessing.process.BaseProcess.start = recorded_process_start


def pytest_sessionfinish(session, exitstatus):
    """The base made above goes once every test passed; a failure's files stay to look at."""
    base = session.config.stash.get(_SHORT_BASETEMP, None)
    if base is not None and exitstatus == 0:
        shutil.rmtree(base, ignore_errors=True)


def pytest_sessionstart(session):
    """Build the native CPU kernels (a compiler run, cached) before any test, so the in-process
    tests use them as a worker would, and the build is charged to no test (the slow mark)."""
    from pagedserve.kernels import cpu_native

    cpu_native.library()


@pytest.fixture(scope="session")
def model_factory(tmp_path_factory):
    """build(arch, **overrides) -> model dir, cached per (arch, overrides) for the session."""
    from pagedserve.tools.demo_model import build_model_dir

    cache: dict = {}

    def build(arch: str = "qwen2", **overrides) -> str:
        key = (arch, tuple(sorted(overrides.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp(f"model-{arch}")
            cache[key] = str(build_model_dir(path, arch, **overrides))
        return cache[key]

    return build


@pytest.fixture
def tmp_dir(tmp_path) -> Path:
    return tmp_path
