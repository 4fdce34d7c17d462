import datetime
import os
import tempfile

import pytest
import torch.distributed as dist


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
