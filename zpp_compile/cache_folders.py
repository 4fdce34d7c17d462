"""zpp_compile's own folders inside Inductor's cache directory, and what keys their entries.

They exist only where Inductor's local FX-graph cache is on: a user who turns Inductor's caching
off (or points it elsewhere with TORCHINDUCTOR_CACHE_DIR) gets the same from zpp_compile.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Optional

import torch


def cache_folder(name: str) -> Optional[str]:
    """<Inductor cache dir>/<name>, or None where Inductor's local FX-graph cache is off."""
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    if not inductor_config.fx_graph_cache or inductor_config.force_disable_caches:
        return None
    return os.path.join(cache_dir(), name)


@functools.cache
def code_version() -> str:
    """A digest of torch's version and every source file of zpp_compile: an entry written by other
    code is never read (a changed quantizer must not reuse an old trace of itself)."""
    digest = hashlib.sha256(torch.__version__.encode())
    package = Path(__file__).resolve().parent
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
