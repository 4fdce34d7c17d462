"""What differs between the torch versions zpp_compile supports, in one place."""

from __future__ import annotations

import torch.distributed as dist

# torch 2.13 renamed the flat-tensor collectives (the old names warn with a FutureWarning).
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
