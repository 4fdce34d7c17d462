"""Bucketing: which collective markers travel together as one collective.

A bucket is a run of consecutive markers in graph order whose payloads add up to at most the
Config's bucket size (a single marker larger than that is a bucket of its own). Graph order is the
same on every rank, so the buckets are too (invariant 1 of README.md).
"""

from __future__ import annotations

from typing import Callable

import torch.fx as fx


def bucket_by_bytes(nodes: list[fx.Node], nbytes: Callable[[fx.Node], int], cap: int) -> list[list[fx.Node]]:
    """Split `nodes` (in graph order) into consecutive runs of at most `cap` bytes; cap 0: one each."""
    buckets: list[list[fx.Node]] = []
    filled = 0
    for node in nodes:
        size = nbytes(node)
        if not buckets or filled + size > cap:
            buckets.append([])
            filled = 0
        buckets[-1].append(node)
        filled += size
    return buckets


def tensor_bytes(node: fx.Node) -> int:
    """Bytes of the tensor a node produces (its fake value)."""
    value = node.meta["val"]
    return value.numel() * value.element_size()
