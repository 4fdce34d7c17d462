"""examples/train_gpt.py as a user runs it (torchrun, 2 processes): what each log line and the
output files report, and the parts of its loop that are plain functions (learning-rate schedule,
loss-curve plot without matplotlib)."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.training_utils import StepRecord, lr_at, plot_loss_curve

ROOT = Path(__file__).resolve().parent.parent


def train(out: Path, *flags: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "examples" / "train_gpt.py"), "--out-dir", str(out), "--data-mb", "0.5",
           "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32", "--batch-size", "2", *flags]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=420, env=env, check=False)


@pytest.mark.timeout(480)
def test_the_example_logs_what_a_torchtitan_user_expects(tmp_path):
    steps, warmup, lr = 4, 2, 1e-3
    done = train(tmp_path, "--model", "hf-llama", "--steps", str(steps), "--warmup", str(warmup), "--lr", str(lr),
                 "--min-lr", "1e-4", "--clip", "0.5", "--grad-accum", "2", "--log-every", "1", "--lowering", "aot_eager")  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "train_gpt_hf-llama-compiled-aot_eager.json").read_text())
    with open(tmp_path / "train_gpt_hf-llama-compiled-aot_eager.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, steps + 1))
    for r in rows:
        expected_lr = lr_at(int(r["step"]), base_lr=lr, min_lr=1e-4, warmup=warmup, total=steps)
        assert math.isclose(float(r["lr"]), expected_lr, rel_tol=1e-4), r
        assert math.isfinite(float(r["loss"])) and float(r["grad_norm"]) > 0, r
    assert summary["grad_accum"] == 2 and summary["tokens_per_step"] == 2 * 2 * 2 * 32
    assert summary["sent_intra_mb_per_rank_step"] > 0 and summary["sent_inter_mb_per_rank_step"] == 0
    assert summary["peak_memory_mb"] > 0 and summary["median_tokens_per_s"] > 0
    log = done.stdout
    assert "compiling (first step)" in log and "done in" in log
    for field in ("loss", "lr", "grad norm", "ms/step", "tok/s", "peak mem", "sent intra", "inter"):
        assert field in log, field
    # the final table
    assert "| median step ms |" in log and "| final train loss, val loss |" in log


def test_learning_rate_warms_up_linearly_then_decays_by_cosine_to_the_minimum():
    kw = dict(base_lr=1.0, min_lr=0.1, warmup=10, total=110)
    assert lr_at(1, **kw) == pytest.approx(0.1) and lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.55)  # half-way through the decay
    assert lr_at(110, **kw) == pytest.approx(0.1) and lr_at(500, **kw) == pytest.approx(0.1)
    decay = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(decay, decay[1:]))


def test_the_loss_curve_is_skipped_with_a_message_without_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    records = [
        StepRecord(1, 5.0, 1e-3, 1.0, seconds=0.1, tokens_per_s=10.0, peak_mem_bytes=1, sent_intra=0, sent_inter=0)
    ]
    why = plot_loss_curve(records, tmp_path / "curve.png", "t")
    assert why is not None and "matplotlib" in why and "pip install" in why
    assert not (tmp_path / "curve.png").exists()
