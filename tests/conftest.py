import os
import tempfile

import pytest

# One Inductor cache for the whole run (workers inherit it), so identical graphs compile once.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(tempfile.gettempdir(), "zpp_compile_inductor_cache"))

from .workers import WorkerPool  # noqa: E402


@pytest.fixture(scope="session")
def pools():
    """pools(world_size) -> a WorkerPool of that size, started on first use and reused."""
    started: dict[int, WorkerPool] = {}

    def get(world_size: int) -> WorkerPool:
        if world_size not in started:
            started[world_size] = WorkerPool(world_size)
        return started[world_size]

    yield get
    for pool in started.values():
        pool.close()
