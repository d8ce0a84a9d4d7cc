import compileall
import gc
import importlib.util
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # every test module imports ``helpers`` (one module: one pool)
# A few test modules reuse another area's reference (``from test_moe_parallel import MOE``): every area
# folder is importable by module name, whichever test pytest collects first.
sys.path[1:1] = [str(p) for p in sorted(Path(__file__).parent.iterdir()) if p.is_dir() and any(p.glob("test_*.py"))]


def pytest_configure(config):
    """Compile ptdp and the tests' helpers to bytecode once, before any process starts. The suite starts
    many Python processes (launchers, workers, the pool's ranks); where ``PYTHONDONTWRITEBYTECODE`` is set,
    as on this project's development machines, none of them leaves its bytecode behind, and each compiled
    the ~180 ptdp modules a worker imports again (0.1-0.4 s of CPU a start). Compiled here (in the
    controller only, under pytest-xdist), they all read it."""
    if hasattr(config, "workerinput"):
        return
    for folder in [*importlib.util.find_spec("ptdp").submodule_search_locations, Path(__file__).parent]:
        compileall.compile_dir(folder, quiet=2)


@pytest.fixture(scope="session", autouse=True)
def _shared_corpus_cache(tmp_path_factory):
    """Build the default corpus once per test session (into a private cache, never the user's)."""
    if "PTDP_CACHE_DIR" not in os.environ:
        os.environ["PTDP_CACHE_DIR"] = str(tmp_path_factory.mktemp("ptdp-cache"))
    yield


@pytest.fixture(autouse=True)
def _environment_restored():
    """Each test leaves ``os.environ`` as it found it. A variable that a library or an in-process command
    sets for good (inductor's cache directory, tokenizers' parallelism, a launcher's markers) would
    otherwise make the next ``helpers.pooled_spawn`` see a changed environment and start the session's
    pool of ranks again (8 processes importing torch)."""
    saved = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    yield
    for key in [k for k in os.environ if k not in saved and k != "PYTEST_CURRENT_TEST"]:
        del os.environ[key]
    for key, value in saved.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """One process training the TINY model (losses, gradient norms, final weights): what every parallel
    layout must reproduce (``helpers.assert_equivalent``)."""
    from helpers import train_run

    return train_run(tmp_path_factory.mktemp("ref"), 1, [])


@pytest.fixture(scope="session")
def reference_8_layers(tmp_path_factory):
    """The same with 8 layers, for layouts of p x v = 8 stages."""
    from helpers import train_run

    return train_run(tmp_path_factory.mktemp("ref8"), 1, ["--num-layers", "8"])


def pytest_collection_finish(session):
    """Keep the collector's full passes short in this process. The imports and the collection leave ~400,000
    objects alive all session (torch, ptdp, every test item), and the in-process tests make and drop schedules,
    traces and tensors by the hundred thousand, so full passes over all of it came often: ~20% of this
    process's time in the NCCL model sweeps. Frozen, the session's objects are skipped; and a full pass after
    every 100 middle-generation passes (CPython's default: 10) leaves more of what a test drops to reference
    counting, which frees everything but cycles (they wait a little longer)."""
    gc.freeze()
    gc.set_threshold(*gc.get_threshold()[:2], 100)
