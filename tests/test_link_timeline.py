"""benchmarks/link_timeline.py's reading of the veth counters (the cluster itself needs root)."""

import pytest

from benchmarks.cluster import rate_bytes_per_s
from benchmarks.link_timeline import Samples, busy, phase_rows, report, timeline

MB_PER_S = 1e6


def _sending_between(start: float, end: float) -> Samples:
    """Counters sampled every 10 ms over [0, 3] s: tx grows at 1 MB/s during [start, end], rx never."""
    rows = []
    for i in range(301):
        t = i / 100
        rows.append((t, int(MB_PER_S * (min(max(t, start), end) - start)), 0))
    return Samples(rows)


def test_a_phase_is_as_busy_as_its_bytes_need_of_its_time():
    samples = _sending_between(1.0, 2.0)
    forward, backward, optimizer = phase_rows(samples, (0.5, 1.0, 2.0, 2.5), MB_PER_S)
    assert "tx   0.00 MB (  0%)" in forward
    assert "tx   1.00 MB (100%)" in backward and "rx   0.00 MB (  0%)" in backward
    assert "(  0%)" in optimizer
    assert busy(500_000, 1.0, MB_PER_S) == pytest.approx(0.5)


def test_the_timeline_shows_where_in_the_step_the_link_is_busy():
    # A 1.1 s step: forward to 0.2 s, backward to 1.0 s, the optimizer to 1.1 s; the link sends
    # from 0.5 s to 1.0 s into it.
    rows = timeline(_sending_between(1.5, 2.0), (1.0, 1.2, 2.0, 2.1), 2.1, MB_PER_S)
    assert len(rows) == 55
    assert rows[0].split() == ["0", "ms", "F", "tx", "0%", "rx", "0%"]
    assert rows[24].split()[:5] == ["480", "ms", "B", "tx", "0%"]
    assert rows[25].split()[:5] == ["500", "ms", "B", "tx", "100%"]
    assert rows[50].split()[:5] == ["1000", "ms", "O", "tx", "0%"]


def test_report_takes_the_slowest_rank_for_each_step():
    samples = _sending_between(1.0, 2.0)
    marks_by_rank = [[(0.5, 1.0, 2.0, 2.5)], [(0.5, 1.0, 2.0, 2.9)]]
    assert "median 2400 ms" in report("x", samples, marks_by_rank, MB_PER_S)


def test_rates_are_read_as_tc_reads_them():
    assert rate_bytes_per_s("100mbit") == 12.5e6
    assert rate_bytes_per_s("1gbit") == 125e6
    with pytest.raises(ValueError, match="tc rate such as 100mbit"):
        rate_bytes_per_s("none")
