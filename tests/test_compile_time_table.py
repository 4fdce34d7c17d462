"""benchmarks/compile_time.py's table over round-robin repeats: each ratio to DDP is taken within
one repeat (the machine drifts between repeats), and a row shows its median run."""

from __future__ import annotations

import argparse

from benchmarks import compile_time


def _row(config: str, repeat: int, first_s: float) -> dict:
    stages = {} if config == "ddp" else {"aot_autograd": first_s / 10}
    rank0 = {"first_s": first_s, "steady_s": 1.0, "rss_mb": 100.0, "fxgraph_hit": 1, "fxgraph_miss": 2,
             "aot_hit": 0, "aot_miss": 1, "stages": stages}  # fmt: skip
    return {"config": config, "layers": 12, "start": "cold", "repeat": repeat, "first_s_max": first_s, "rank0": rank0}


def _args(repeats: int) -> argparse.Namespace:
    return argparse.Namespace(nproc=4, ranks_per_node=2, layers="12", width=768, configs="ddp,zeropp_full",
                              starts="cold", repeats=repeats)  # fmt: skip


def test_ratios_are_taken_within_each_repeat_and_the_row_is_its_median_run():
    # DDP drifts 80 -> 100 -> 60 s; zeropp is 1.2x, 1.3x and 2.0x of the DDP of its own repeat.
    rows = [_row("ddp", 0, 80), _row("zeropp_full", 0, 96), _row("ddp", 1, 100), _row("zeropp_full", 1, 130),
            _row("ddp", 2, 60), _row("zeropp_full", 2, 120)]  # fmt: skip
    table = compile_time.table(rows, _args(3))
    zeropp = next(line for line in table.splitlines() if line.startswith("| zeropp_full |"))  # the first table's
    # The median of the repeats' ratios, 1.30x; the ratio of the medians would say 120 / 80 = 1.50x.
    assert "| 120.0 (96.0-130.0) | 1.30x (1.20-2.00) |" in zeropp
    assert "--repeats 3" in table and "Medians of 3 round-robin repeats" in table
    # The stage table shows the median run (120 s: AOTAutograd 12.0 s), not the first.
    assert "| zeropp_full | 12 | cold | 12.0 |" in table


def test_one_repeat_keeps_the_plain_table():
    table = compile_time.table([_row("ddp", 0, 80), _row("zeropp_full", 0, 96)], _args(1))
    assert "| 96.0 | 1.20x |" in table
    assert "--repeats" not in table and "Medians" not in table
