"""The benchmarks' progress bars (benchmarks/_common.tracked): every item through, drawn by the
launching process and rank 0 only."""

from __future__ import annotations

from benchmarks._common import tracked


def test_a_benchmark_loop_shows_its_progress_on_rank_0_only(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    assert list(tracked(range(3), "timed steps")) == [0, 1, 2]
    shown = capsys.readouterr().err
    assert "timed steps" in shown and "3/3" in shown, shown
    monkeypatch.setenv("RANK", "1")
    assert list(tracked(["a", "b"], "timed steps")) == ["a", "b"]
    assert capsys.readouterr().err == ""
    monkeypatch.delenv("RANK")  # the launching process (no RANK): shown
    list(tracked(range(2), "configs"))
    assert "configs" in capsys.readouterr().err
