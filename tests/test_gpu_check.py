"""benchmarks/gpu_check.py on a machine without a GPU: one line, exit 0, nothing written."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SKIP_MESSAGE = "no CUDA GPU: skipping gpu_check (needs a CUDA device;"


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script runs the whole check")
def test_without_a_gpu_it_says_so_and_exits_0_writing_nothing(tmp_path):
    default_doc = ROOT / "docs" / "gpu_check_report.md"  # the default --out
    before = default_doc.stat().st_mtime_ns if default_doc.exists() else None
    out = tmp_path / "report.md"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--out", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(SKIP_MESSAGE), done.stdout
    assert len(done.stdout.strip().splitlines()) == 1
    assert not out.exists()
    assert (default_doc.stat().st_mtime_ns if default_doc.exists() else None) == before
    assert list(tmp_path.iterdir()) == []
