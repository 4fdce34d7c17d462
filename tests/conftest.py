import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

# Without a GPU the Triton kernels run in Triton's interpreter, on CPU tensors. Triton reads this
# when a kernel is defined, so it must be set before zpp_compile.codegen.triton_quantize loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


@pytest.fixture(scope="session")
def group_of_one():
    """A real one-rank gloo group in the test process: pass unit tests need real group names."""
    if not dist.is_initialized():
        fd, path = tempfile.mkstemp(prefix="zpp_store_")
        os.close(fd)
        os.unlink(path)
        dist.init_process_group(
            "gloo", init_method=f"file://{path}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=60)
        )
    return dist.group.WORLD.group_name


# Modules whose tests launch processes of their own (torchrun, the simulated cluster).
LAUNCHING_MODULES = {"test_cluster_harness", "test_example", "test_faults"}
# Modules whose tests run for minutes: long training runs and whole-model compiles.
SLOW_MODULES = {
    "test_long_run",
    "test_example",
    "test_cluster_harness",
    "test_model_features",
    "test_checkpoint",
    "test_hf_architectures",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark tests `distributed` (a worker pool or processes of their own) and `slow`, so that
    `make test-fast` (-m "not distributed and not slow") keeps the pass and kernel unit tests."""
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if "pools" in getattr(item, "fixturenames", ()) or module in LAUNCHING_MODULES:
            item.add_marker(pytest.mark.distributed)
        if module in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
