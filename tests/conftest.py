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


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> list[float]:
    """Single-process losses of the TINY model: what every parallel layout must reproduce."""
    from helpers import losses, train_metrics

    return losses(train_metrics(tmp_path_factory.mktemp("ref"), 1, []))
