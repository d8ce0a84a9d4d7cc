import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session", autouse=True)
def _shared_corpus_cache(tmp_path_factory):
    """Build the default corpus once per test session (into a private cache, never the user's)."""
    if "PTDP_CACHE_DIR" not in os.environ:
        os.environ["PTDP_CACHE_DIR"] = str(tmp_path_factory.mktemp("ptdp-cache"))
    yield
