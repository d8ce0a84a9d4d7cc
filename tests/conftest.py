import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # every test module imports ``helpers`` (one module: one pool)
# A few test modules reuse another area's reference (``from test_moe_parallel import MOE``): every area
# folder is importable by module name, whichever test pytest collects first.
sys.path[1:1] = [str(p) for p in sorted(Path(__file__).parent.iterdir()) if p.is_dir() and any(p.glob("test_*.py"))]


@pytest.fixture(scope="session", autouse=True)
def _shared_corpus_cache(tmp_path_factory):
    """Build the default corpus once per test session (into a private cache, never the user's)."""
    if "PTDP_CACHE_DIR" not in os.environ:
        os.environ["PTDP_CACHE_DIR"] = str(tmp_path_factory.mktemp("ptdp-cache"))
    yield


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

