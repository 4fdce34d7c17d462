"""GPU readiness check: one command, a few minutes, everything printed and written in one go.

    python benchmarks/gpu_check.py [--quick] [--sections env,kernels,throughput,training] [--steps 30]
                                   [--out docs/gpu_check_report.md]

Sections (each runs even if another failed; the exit status is 1 if any failed):
  1. env         torch, triton, CUDA, NCCL versions, the device and its memory, the registry's choice.
  2. kernels     every Triton kernel of zpp_compile/codegen (int8 quantize_packed / dequantize_packed;
                 int4 quantize_swizzled, dequantize_reduce_requantize, dequantize_reduce), taken from
                 the registry, against the torch reference (the registry's "inductor" set, run op by op)
                 on the same CUDA tensors and on CPU copies of them: fp32/bf16/fp16, sizes off the block
                 and the tile, all-zero, tiny, inf and nan blocks, with and without error feedback.
                 Bitwise equality, and where not equal how many elements differ, by how much and in
                 which bits. Payloads and dequantized values must be bitwise equal to one of the two
                 references (FAIL otherwise); outputs made by a multiply-add (error-feedback errors,
                 re-quantized sums), which Triton may contract to an FMA, may differ within a bound (WARN).
  3. throughput  each kernel, Triton and Inductor (torch.compile of the reference), in GB/s (bytes read
                 + written) against dst.copy_(src) of the same number of bytes; CUDA events around
                 back-to-back calls after warm-up, median of several samples.
  4. training    world size 1 ("cuda:nccl,cpu:gloo", what init_process_group() picks on a CUDA machine),
                 examples/gpt.py's GPT, zpp_compile.shard with Config() and with
                 Config(quantize_weights=True, quantize_gradients=True), torch.compile(backend="zeropp"),
                 AdamW, --steps steps on stdlib-source bytes, against the same runs on CPU (gloo), compiled
                 and eager, started first in the background: max relative loss difference per config
                 against a stated tolerance, step-1 loss against the unsharded model, first-step (compile)
                 and median step times. Also shard() and two eager steps under init_process_group("nccl")
                 alone. Each run is its own process (a crash or hang stays in it).
Sections 2 and 3 also run in their own processes, with timeouts, so a CUDA error in one cannot
poison the others. Without a CUDA device the script prints one line and exits 0, writing nothing.

Developer-only: `--device cpu-interpret` runs the same code on CPU tensors at tiny sizes, with the
Triton kernels in Triton's interpreter (TRITON_INTERPRET=1) and the "GPU" training runs on CPU, to
check the comparison and reporting code on a machine without a GPU. Its numbers mean nothing, and
it writes a file only when --out is given.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # zpp_compile and examples from this checkout, installed or not

SKIP_MESSAGE = (
    "no CUDA GPU: skipping gpu_check (needs a CUDA device; Triton kernels are tested on CPU in "
    "Triton's interpreter by tests/codegen)"
)
SECTIONS = ("env", "kernels", "throughput", "training")
SECTION_TITLES = {
    "env": "1. Environment",
    "kernels": "2. Kernel bit-exactness: Triton against the torch reference on the same tensors",
    "throughput": "3. Throughput",
    "training": "4. Compiled training on one GPU against CPU",
}
DEFAULT_OUT = ROOT / "docs" / "gpu_check_report.md"  # docs/gpu_check.md describes the check and its findings
CPU_INTERPRET = "cpu-interpret"
SEVERITY = {"PASS": 0, "SKIP": 0, "WARN": 1, "FAIL": 2}
# Wall-clock limits of the child processes (seconds): generous, so that only a hang reaches them.
SECTION_TIMEOUT_S = {"kernels": 300, "throughput": 300}
GPU_TRAINING_TIMEOUT_S = 300
CPU_TRAINING_TIMEOUT_S = 600  # counted from their start, at the beginning of the check


# ----------------------------------------------------------------------------------------------
# Sizes


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What each mode checks: (numel, block) for int8; (nodes or senders, local or rows, chunk, block)
    for int4; the element count timed in section 3 and how it is timed."""

    int8_cases: tuple[tuple[int, int], ...]
    int4_cases: tuple[tuple[int, int, int, int], ...]
    throughput_numel: int
    cpu_reference_max_numel: int  # cases up to this size are also compared with the reference on CPU
    timing_samples: int
    calls_per_sample: int


_SMALL_INT8 = ((77, 8), (1000, 200), (5000, 256))
# 4224 = 33 blocks of 128: one more block than a Triton program holds (32), so two programs.
_SMALL_INT4 = ((2, 2, 64, 8), (2, 4, 600, 200), (2, 3, 4224, 128), (4, 1, 256, 64))
SIZES = {
    "full": Sizes(
        int8_cases=(*_SMALL_INT8, (2**20 + 3, 256), (2**22, 1024), (2**24 + 7, 256)),
        int4_cases=(*_SMALL_INT4, (2, 8, 128 * 1025, 128), (8, 8, 128 * 1025, 128)),
        throughput_numel=2**26,
        cpu_reference_max_numel=2**26,
        timing_samples=7,
        calls_per_sample=10,
    ),
    "quick": Sizes(
        int8_cases=(*_SMALL_INT8, (2**20 + 3, 256)),
        int4_cases=(*_SMALL_INT4, (2, 8, 128 * 1025, 128)),
        throughput_numel=2**24,
        cpu_reference_max_numel=2**22,
        timing_samples=5,
        calls_per_sample=10,
    ),
    CPU_INTERPRET: Sizes(
        int8_cases=_SMALL_INT8,
        int4_cases=_SMALL_INT4[:3],
        throughput_numel=2**14,
        cpu_reference_max_numel=2**22,
        timing_samples=2,
        calls_per_sample=1,
    ),
}


def sizes_for(args: argparse.Namespace) -> Sizes:
    if args.device == CPU_INTERPRET:
        return SIZES[CPU_INTERPRET]
    return SIZES["quick" if args.quick else "full"]


def tensor_device(args: argparse.Namespace) -> str:
    return "cpu" if args.device == CPU_INTERPRET else "cuda"


# ----------------------------------------------------------------------------------------------
# Section results and markdown


@dataclasses.dataclass
class SectionResult:
    name: str
    status: str  # PASS, WARN, FAIL or SKIP
    lines: list[str]
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(data: dict[str, Any]) -> SectionResult:
        return SectionResult(**data)


def worst_status(statuses: Sequence[str]) -> str:
    return max(statuses, key=lambda s: SEVERITY[s], default="PASS")


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def error_summary(exc: BaseException) -> str:
    """`Type: first line ... last line` of an exception (Triton's compile errors put the cause last)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if len(lines) > 1:
        text += f" ... {lines[-1][:300]}"
    return f"{type(exc).__name__}: {text}".replace("`", "'")


def failure_lines(what: str, exc: BaseException) -> list[str]:
    """A traceback summary for the report: the last frames and the error."""
    frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
    tail = "".join(frames[-4:]).rstrip().splitlines()[-12:]
    return [f"**{what} failed**: `{error_summary(exc)}`", "", "```", *tail, "```"]


class ErrorLog:
    """Prints each distinct error's traceback once, later ones as one line (keeps the log readable)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def report(self, what: str, exc: BaseException) -> None:
        summary = error_summary(exc)
        if summary in self.seen:
            print(f"{what}: {summary} (traceback above)", flush=True)
            return
        self.seen.add(summary)
        print(f"{what}: {summary}", flush=True)
        traceback.print_exception(type(exc), exc, exc.__traceback__, limit=-6)


def format_float(value: float) -> str:
    if value == 0:
        return "0"
    if math.isinf(value) or math.isnan(value):
        return str(value)
    return f"{value:.3g}"


# ----------------------------------------------------------------------------------------------
# Child processes: streamed output, a timeout, killed with everything they started


class ChildProcess:
    """A subprocess whose output is echoed line by line with a prefix (and its tail kept), in its
    own process group so that a timeout kills its compile workers too."""

    def __init__(self, cmd: list[str], env: dict[str, str], prefix: str) -> None:
        self.started = time.monotonic()
        self.tail: collections.deque[str] = collections.deque(maxlen=30)
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            errors="replace", start_new_session=True, cwd=ROOT,
        )  # fmt: skip
        self.pump = threading.Thread(target=self._echo, args=(prefix,), daemon=True)
        self.pump.start()

    def _echo(self, prefix: str) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.tail.append(line.rstrip())
            print(f"{prefix}{line}", end="", flush=True)

    def wait(self, timeout_s: float) -> Optional[int]:
        """The exit status, or None if it ran past timeout_s (counted from its start) and was killed."""
        remaining = max(1.0, timeout_s - (time.monotonic() - self.started))
        try:
            rc: Optional[int] = self.proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = None
        self.pump.join(timeout=5)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # its own group (start_new_session)
            except ProcessLookupError:
                pass
            self.proc.wait()

    def tail_text(self) -> str:
        return "\n".join(self.tail)


def child_env(args: argparse.Namespace, **extra: str) -> dict[str, str]:
    """The environment of every child: the interpreter switch set or cleared as the mode says,
    no forced kernel set, and no launcher variables (each child is a world of one)."""
    warnings = "ignore::FutureWarning,ignore::DeprecationWarning"  # torch's deprecation notices, as in pytest
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS=warnings, **extra)
    for name in ("ZPP_QUANT_KERNELS", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):  # fmt: skip
        env.pop(name, None)
    if args.device == CPU_INTERPRET:
        env["TRITON_INTERPRET"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
    else:
        env.pop("TRITON_INTERPRET", None)  # on a GPU the kernels must be compiled, not interpreted
    return env


def mode_flags(args: argparse.Namespace) -> list[str]:
    return ["--device", args.device] + (["--quick"] if args.quick else [])


def run_section_in_child(name: str, args: argparse.Namespace) -> SectionResult:
    """Sections 2 and 3 run in a fresh process: their result comes back as JSON."""
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        result_json = Path(tmp) / "section.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child-section", name,
               "--result-json", str(result_json), *mode_flags(args)]  # fmt: skip
        child = ChildProcess(cmd, child_env(args), prefix=f"[{name}] ")
        rc = child.wait(SECTION_TIMEOUT_S[name])
        if result_json.exists():
            return SectionResult.from_json(json.loads(result_json.read_text()))
        why = f"killed after {SECTION_TIMEOUT_S[name]} s" if rc is None else f"exit status {rc}, no result"
        return SectionResult(name, "FAIL", [f"**the section's process failed** ({why}); its last output:", "",
                                            "```", child.tail_text(), "```"])  # fmt: skip


def child_section_main(args: argparse.Namespace) -> int:
    sizes, device = sizes_for(args), tensor_device(args)
    sections = {"kernels": kernels_section, "throughput": throughput_section}
    result = run_guarded(args.child_section, lambda: sections[args.child_section](device, sizes))
    Path(args.result_json).write_text(json.dumps(result.to_json()))
    return 0


def run_guarded(name: str, section: Callable[[], SectionResult]) -> SectionResult:
    """Run a section; any exception becomes a FAIL with its traceback summary."""
    start = time.monotonic()
    try:
        result = section()
    except Exception as exc:  # noqa: BLE001  (the whole point: report it and go on)
        traceback.print_exc()
        result = SectionResult(name, "FAIL", failure_lines(f"section {name}", exc))
    result.seconds = time.monotonic() - start
    return result


# ----------------------------------------------------------------------------------------------
# 1. Environment


def environment_section(args: argparse.Namespace) -> SectionResult:
    rows: list[tuple[str, object]] = [
        ("python", f"{platform.python_version()} ({sys.executable})"),
        ("torch", torch.__version__),
        ("torch built with CUDA", torch.version.cuda),
        ("triton", _triton_version()),
        ("zpp_compile checkout", _git_revision()),
        ("CPU cores", os.cpu_count()),
        ("float32 matmul precision", torch.get_float32_matmul_precision()),
    ]
    if args.device == CPU_INTERPRET:
        rows.append(("device", "cpu-interpret: CPU tensors, Triton's interpreter (developer dry run)"))
    else:
        rows += _cuda_rows()
    forced = os.environ.get("ZPP_QUANT_KERNELS")
    if forced:
        rows.append(("ZPP_QUANT_KERNELS", f"{forced!r} in this shell; unset for every section of the check"))
    return SectionResult("env", "PASS", markdown_table(["item", "value"], rows))


def _cuda_rows() -> list[tuple[str, object]]:
    props = torch.cuda.get_device_properties(0)
    free, total = torch.cuda.mem_get_info(0)
    rows: list[tuple[str, object]] = [
        ("device", f"{props.name} (cuda:0 of {torch.cuda.device_count()})"),
        ("compute capability", f"{props.major}.{props.minor}"),
        ("multiprocessors", props.multi_processor_count),
        ("device memory", f"{total / 2**30:.1f} GiB total, {free / 2**30:.1f} GiB free"),
        ("NCCL", _nccl_version()),
        ("driver, clocks (nvidia-smi)", _nvidia_smi()),
    ]
    try:
        from zpp_compile.codegen.registry import quant_kernels

        rows.append(("kernel set the registry gives cuda", quant_kernels("cuda").name))
    except Exception as exc:  # noqa: BLE001
        rows.append(("kernel set the registry gives cuda", f"error: {type(exc).__name__}: {exc}"))
    return rows


def _triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except Exception as exc:  # noqa: BLE001
        return f"not importable ({type(exc).__name__}: {exc})"


def _nccl_version() -> str:
    try:
        return ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as exc:  # noqa: BLE001
        return f"unknown ({type(exc).__name__})"


def _nvidia_smi() -> str:
    query = "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem,power.limit"
    try:
        out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=20, check=True).stdout.strip()  # fmt: skip
        return out.splitlines()[0] if out else "no output"
    except Exception as exc:  # noqa: BLE001
        return f"unavailable ({type(exc).__name__})"


def _git_revision() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                             timeout=10, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=ROOT, timeout=10).stdout.strip()  # fmt: skip
        return rev + (" with uncommitted changes" if dirty else "")
    except Exception:  # noqa: BLE001
        return "unknown (not a git checkout)"


# ----------------------------------------------------------------------------------------------
# 2. Kernel bit-exactness


@dataclasses.dataclass
class Difference:
    """The Triton output against one reference. For payloads `differing` counts bytes and
    `max_abs_diff` compares the decoded values; for float outputs both are per element (nan == nan);
    inf where a non-finite value meets another value."""

    bitwise: bool
    differing: int
    total: int
    max_abs_diff: float
    nan_positions_match: bool
    first_bits: str  # where not bitwise: the first differing element's bits, Triton / reference

    @property
    def values_equal(self) -> bool:
        """Equal but for the bits of nans."""
        return self.differing == 0 and self.nan_positions_match

    def cell(self) -> str:
        if self.bitwise:
            return "bitwise"
        if self.values_equal:
            return f"nan bits only, {self.first_bits}"
        return f"{self.differing} of {self.total}, max {format_float(self.max_abs_diff)}, {self.first_bits}"


@dataclasses.dataclass
class Comparison:
    """One output of one case: the Triton kernel's against the torch reference run on the same CUDA
    tensors and, where given, on CPU copies of them. A `strict` output must be bitwise equal to one of
    the two; the others (multiply-adds that Triton may contract to FMA) may differ by at most `bound`."""

    kernel: str
    output: str
    dtype: str
    case: str
    strict: bool
    vs_device: Optional[Difference] = None
    vs_cpu: Optional[Difference] = None
    bound: float = 0.0
    error: str = ""

    def differences(self) -> list[Difference]:
        return [d for d in (self.vs_device, self.vs_cpu) if d is not None]

    @property
    def verdict(self) -> str:
        found = self.differences()
        if self.error or not found:
            return "ERROR"
        if all(d.bitwise for d in found):
            return "bitwise"
        if self.vs_cpu is not None and self.vs_cpu.bitwise:
            return "bitwise vs CPU only"
        if self.vs_device is not None and self.vs_device.bitwise:
            return "bitwise vs device only"
        if any(d.values_equal for d in found):
            return "nan bits differ"
        if not self.strict and any(d.nan_positions_match and d.max_abs_diff <= self.bound for d in found):
            return "within bound"
        return "MISMATCH"

    @property
    def status(self) -> str:
        if self.verdict in ("bitwise", "bitwise vs CPU only", "bitwise vs device only"):
            return "PASS"
        return "WARN" if self.verdict in ("nan bits differ", "within bound") else "FAIL"


@dataclasses.dataclass(frozen=True)
class Label:
    kernel: str
    output: str
    dtype: torch.dtype
    case: str


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def same_bits(got: Tensor, want: Tensor) -> bool:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    return torch.equal(got.reshape(-1).contiguous().view(torch.uint8), want.reshape(-1).contiguous().view(torch.uint8))


def first_bit_difference(got: Tensor, want: Tensor) -> str:
    """'[index] 0xGOT / 0xWANT' for the first element whose bits differ (e.g. a nan's sign or payload)."""
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[got.element_size()]
    got_bits, want_bits = got.reshape(-1).view(as_int), want.reshape(-1).view(as_int)
    index = int((got_bits != want_bits).nonzero()[0])
    mask = (1 << (8 * got.element_size())) - 1
    return f"[{index}] {int(got_bits[index]) & mask:#x} / {int(want_bits[index]) & mask:#x}"


def difference(got: Tensor, want: Tensor, decode: Optional[Callable[[Tensor], Tensor]]) -> Difference:
    """Bitwise first; then what differs: bytes (payloads, `decode` given) or elements, and the largest
    difference of the (decoded) values."""
    if got.shape != want.shape or got.dtype != want.dtype:
        raise ValueError(f"shape/dtype {tuple(got.shape)} {got.dtype} != reference {tuple(want.shape)} {want.dtype}")
    want = want.to(got.device)
    bitwise = same_bits(got, want)
    if decode is not None:
        differing = int((got != want).sum())
        got_values, want_values = decode(got).float(), decode(want).float()
    else:
        got_values, want_values = got.float(), want.float()
    same = (got_values == want_values) | (got_values.isnan() & want_values.isnan())
    if decode is None:
        differing = int((~same).sum())
    diff = torch.where(same, torch.zeros_like(got_values), (got_values - want_values).abs())
    diff = torch.nan_to_num(diff, nan=math.inf, posinf=math.inf)
    return Difference(
        bitwise=bitwise, differing=differing, total=got.numel(),
        max_abs_diff=float(diff.max()) if diff.numel() else 0.0,
        nan_positions_match=torch.equal(got_values.isnan(), want_values.isnan()),
        first_bits="" if bitwise else first_bit_difference(got, want),
    )  # fmt: skip


def compare(
    label: Label,
    got: Tensor,
    want: Tensor,
    want_on_cpu: Optional[Tensor],
    *,
    strict: bool,
    decode: Optional[Callable[[Tensor], Tensor]] = None,
    bound: float = 0.0,
) -> Comparison:
    """The Triton output against the reference on the device and (where given) on CPU."""
    result = Comparison(label.kernel, label.output, dtype_name(label.dtype), label.case, strict, bound=bound)
    try:
        result.vs_device = difference(got, want, decode)
        if want_on_cpu is not None:
            result.vs_cpu = difference(got, want_on_cpu, decode)
    except ValueError as exc:
        result.error = str(exc)
    return result


def failed_comparison(label: Label, exc: BaseException) -> Comparison:
    return Comparison(label.kernel, label.output, dtype_name(label.dtype), label.case, True, error=error_summary(exc))


def heavy_tailed(shape: tuple[int, ...], seed: int) -> Tensor:
    """Normal values times a log-normal scale: many magnitudes in one tensor (fp16-safe: |x| < 1e4)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g).clamp(max=6))


def tiny_factor(dtype: torch.dtype) -> float:
    """Small but normal in the dtype (fp16's smallest normal is 6e-5)."""
    return 1e-4 if dtype == torch.float16 else 1e-30


def int8_shard(numel: int, block: int, dtype: torch.dtype, seed: int) -> Tensor:
    """A shard whose first blocks are special: all zero, tiny, one nan, one -inf, one +inf; the
    last block is partial when numel is not a multiple of block."""
    x = heavy_tailed((numel,), seed)
    starts = list(range(0, numel, block))
    x[:block] = 0
    if len(starts) > 1:
        x[starts[1] : starts[1] + block] *= tiny_factor(dtype)
    for index, value in zip(starts[2:5], (math.nan, -math.inf, math.inf)):
        x[index + 1] = value
    return x.to(dtype)


def int4_values(shape: tuple[int, int, int], block: int, dtype: torch.dtype, seed: int) -> Tensor:
    """[N, L, chunk] values with an all-zero block, a nan, a -inf and a tiny block (as tests/codegen)."""
    v = heavy_tailed(shape, seed)
    v[0, 0, :block] = 0
    v[-1, -1, -1] = math.nan
    v[0, -1, 0] = -math.inf
    v[-1, 0, -block:] *= tiny_factor(dtype)
    return v.to(dtype)


def feedback_residual(shape: tuple[int, ...], seed: int) -> Tensor:
    """A residual as error feedback hands it over: bf16-stored state, read back as fp32."""
    g = torch.Generator().manual_seed(seed)
    return (0.05 * torch.randn(shape, generator=g)).to(torch.bfloat16).float()


def int4_max_scale(payload: Tensor, chunk: int) -> float:
    """The largest finite block scale in int4 payloads [..., payload]: one quantization step."""
    scales = payload[..., chunk // 2 :].contiguous().view(torch.float32)
    finite = scales[torch.isfinite(scales)]
    return float(finite.max()) if finite.numel() else 0.0


def float_bound(want: Tensor) -> float:
    """For fp32 sums: a few ulps of the largest magnitude (G additions, each maybe fused)."""
    finite = want[torch.isfinite(want)]
    return 1e-5 * float(finite.abs().max()) if finite.numel() else 0.0


class KernelPair:
    """The registry's Triton kernel set (what the passes get on CUDA) and its torch reference."""

    def __init__(self, device: str, cpu_reference_max_numel: int) -> None:
        from zpp_compile.codegen.registry import kernel_set

        self.triton = kernel_set("triton")
        self.reference = kernel_set("inductor")  # the plain torch code, here run op by op
        self.device = device
        self.cpu_reference_max_numel = cpu_reference_max_numel

    def on_cpu(self, numel: int, fn: Callable[[], Any]) -> Any:
        """The reference on CPU tensors, for cases small enough to be cheap there; else None."""
        return fn() if numel <= self.cpu_reference_max_numel else None


def int8_quantize_case(k: KernelPair, numel: int, block: int, dtype: torch.dtype) -> list[Comparison]:
    from zpp_compile.codegen import quantize

    label = Label("int8 quantize_packed", "payload", dtype, f"numel {numel}, block {block}")
    shard = int8_shard(numel, block, dtype, seed=numel + block)
    on_device = shard.to(k.device)
    got, want = k.triton.quantize_packed(on_device, block), k.reference.quantize_packed(on_device, block)
    want_cpu = k.on_cpu(numel, lambda: k.reference.quantize_packed(shard, block))
    decode = lambda p: quantize.dequantize_packed(p, 1, numel, block, torch.float32)  # noqa: E731
    return [compare(label, got, want, want_cpu, strict=True, decode=decode)]


def int8_dequantize_case(k: KernelPair, numel: int, block: int, dtype: torch.dtype, ranks: int = 3) -> list[Comparison]:
    label = Label("int8 dequantize_packed", f"values ({dtype_name(dtype)} out)", dtype,
                  f"{ranks} x numel {numel}, block {block}")  # fmt: skip
    shards = [int8_shard(numel, block, dtype, seed=numel + block + r) for r in range(ranks)]
    payloads = torch.cat([k.reference.quantize_packed(s, block) for s in shards])  # on CPU: the same bytes
    on_device = payloads.to(k.device)
    got = k.triton.dequantize_packed(on_device, ranks, numel, block, dtype)
    want = k.reference.dequantize_packed(on_device, ranks, numel, block, dtype)
    want_cpu = k.on_cpu(numel * ranks, lambda: k.reference.dequantize_packed(payloads, ranks, numel, block, dtype))
    return [compare(label, got, want, want_cpu, strict=True)]


def int4_swizzled_case(
    k: KernelPair, shape: tuple[int, int, int, int], dtype: torch.dtype, feedback: bool
) -> list[Comparison]:
    from zpp_compile.codegen import int4

    nodes, local, chunk, block = shape
    case = f"[{nodes}, {local}, {chunk}], block {block}" + (", error feedback" if feedback else "")
    values = int4_values((nodes, local, chunk), block, dtype, seed=chunk + block)
    residual = feedback_residual((local, nodes, chunk), seed=chunk) if feedback else None
    dev_values, dev_residual = values.to(k.device), None if residual is None else residual.to(k.device)
    got_payload, got_error = k.triton.int4_quantize_swizzled(dev_values, block, dev_residual)
    want_payload, want_error = k.reference.int4_quantize_swizzled(dev_values, block, dev_residual)
    cpu = k.on_cpu(values.numel(), lambda: k.reference.int4_quantize_swizzled(values, block, residual))
    decode = lambda p: int4.dequantize_int4_chunks(p, chunk, block)  # noqa: E731
    kernel = "int4 quantize_swizzled"
    out = [compare(Label(kernel, "payload", dtype, case), got_payload, want_payload, cpu and cpu[0],
                   strict=True, decode=decode)]  # fmt: skip
    if feedback:
        step = int4_max_scale(want_payload, chunk)
        out.append(compare(Label(kernel, "error (fp32)", dtype, case), got_error, want_error, cpu and cpu[1],
                           strict=False, bound=step))  # fmt: skip
    return out


def int4_reduce_requantize_case(k: KernelPair, shape: tuple[int, int, int, int], feedback: bool) -> list[Comparison]:
    from zpp_compile.codegen import int4

    senders, rows, chunk, block = shape
    case = f"{senders} senders x [{rows}, {chunk}], block {block}" + (", error feedback" if feedback else "")
    payloads = int4.quantize_int4_chunks(int4_values((senders, rows, chunk), block, torch.float32, chunk), block)
    residual = feedback_residual((rows, chunk), seed=chunk + 1) if feedback else None
    dev_payloads, dev_residual = payloads.to(k.device), None if residual is None else residual.to(k.device)
    got_payload, got_error = k.triton.int4_dequantize_reduce_requantize(dev_payloads, chunk, block, dev_residual)
    want_payload, want_error = k.reference.int4_dequantize_reduce_requantize(dev_payloads, chunk, block, dev_residual)
    cpu = k.on_cpu(senders * rows * chunk,
                   lambda: k.reference.int4_dequantize_reduce_requantize(payloads, chunk, block, residual))  # fmt: skip
    decode = lambda p: int4.dequantize_int4_chunks(p, chunk, block)  # noqa: E731
    step = int4_max_scale(want_payload, chunk)
    kernel = "int4 dequantize_reduce_requantize"
    out = [compare(Label(kernel, "payload", torch.float32, case), got_payload, want_payload, cpu and cpu[0],
                   strict=False, decode=decode, bound=step)]  # fmt: skip
    if feedback:
        out.append(compare(Label(kernel, "error (fp32)", torch.float32, case), got_error, want_error,
                           cpu and cpu[1], strict=False, bound=step))  # fmt: skip
    return out


def int4_reduce_case(k: KernelPair, shape: tuple[int, int, int, int]) -> list[Comparison]:
    from zpp_compile.codegen import int4

    senders, rows, chunk, block = shape
    case = f"{senders} senders x [{rows}, {chunk}], block {block}"
    payloads = int4.quantize_int4_chunks(int4_values((senders, rows, chunk), block, torch.float32, chunk), block)
    dev_payloads = payloads.to(k.device)
    got = k.triton.int4_dequantize_reduce(dev_payloads, chunk, block)
    want = k.reference.int4_dequantize_reduce(dev_payloads, chunk, block)
    want_cpu = k.on_cpu(senders * rows * chunk, lambda: k.reference.int4_dequantize_reduce(payloads, chunk, block))
    label = Label("int4 dequantize_reduce", "sums (fp32)", torch.float32, case)
    return [compare(label, got, want, want_cpu, strict=False, bound=float_bound(want))]


KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernel_cases(k: KernelPair, sizes: Sizes) -> list[tuple[Label, Callable[[], list[Comparison]]]]:
    """Every case as (a label for its failure, the call that checks it)."""
    cases: list[tuple[Label, Callable[[], list[Comparison]]]] = []
    for numel, block in sizes.int8_cases:
        for dtype in KERNEL_DTYPES:
            where = f"numel {numel}, block {block}"
            cases.append((Label("int8 quantize_packed", "payload", dtype, where),
                          lambda n=numel, b=block, d=dtype: int8_quantize_case(k, n, b, d)))  # fmt: skip
            cases.append((Label("int8 dequantize_packed", "values", dtype, where),
                          lambda n=numel, b=block, d=dtype: int8_dequantize_case(k, n, b, d)))  # fmt: skip
    for shape in sizes.int4_cases:
        where = f"{list(shape[:3])}, block {shape[3]}"
        for feedback in (False, True):
            for dtype in KERNEL_DTYPES:
                cases.append((Label("int4 quantize_swizzled", "payload", dtype, where),
                              lambda s=shape, d=dtype, f=feedback: int4_swizzled_case(k, s, d, f)))  # fmt: skip
            cases.append((Label("int4 dequantize_reduce_requantize", "payload", torch.float32, where),
                          lambda s=shape, f=feedback: int4_reduce_requantize_case(k, s, f)))  # fmt: skip
        cases.append((Label("int4 dequantize_reduce", "sums", torch.float32, where),
                      lambda s=shape: int4_reduce_case(k, s)))  # fmt: skip
    return cases


def run_kernel_cases(k: KernelPair, sizes: Sizes) -> list[Comparison]:
    comparisons: list[Comparison] = []
    errors = ErrorLog()
    for label, check in kernel_cases(k, sizes):
        try:
            found = check()
            if k.device == "cuda":
                torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001  (one case's failure is reported, the others still run)
            errors.report(f"{label.kernel} {dtype_name(label.dtype)} {label.case}", exc)
            found = [failed_comparison(label, exc)]
        for c in found:
            if c.verdict not in ("bitwise", "ERROR"):
                print(f"{c.kernel} [{c.output}] {c.dtype} {c.case}: {c.verdict}", flush=True)
        comparisons += found
    return comparisons


def kernels_section(device: str, sizes: Sizes) -> SectionResult:
    if device == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1", "cpu-interpret needs TRITON_INTERPRET=1 before triton loads"
    comparisons = run_kernel_cases(KernelPair(device, sizes.cpu_reference_max_numel), sizes)
    lines = [
        f'Triton kernels from `registry.kernel_set("triton")` (what the passes get on CUDA) against '
        f'`kernel_set("inductor")`, the torch reference of codegen/quantize.py and int4.py, run op by op '
        f'on the same {device} tensors ("torch on {device}") and on CPU copies of them ("torch on CPU", '
        f"cases up to {sizes.cpu_reference_max_numel} values: what a CPU rank of a mixed job puts on the "
        f"wire). Inputs: heavy-tailed values with an all-zero block, a tiny block, nan, -inf and +inf "
        f"blocks; sizes off the block and off a Triton program's tile.",
        "",
        "Verdicts: **bitwise** against both references, or against one of them only (PASS: torch on CUDA "
        "computes `tensor / python_scalar` as a multiplication by the reciprocal, not an IEEE division "
        "like CPU torch and the Triton kernels, so its block scales can differ in the last bit); **nan "
        "bits differ** (equal values, a nan's bits differ: WARN); **within bound** (outputs made by a "
        "multiply-add, which Triton may contract to an FMA: error-feedback errors and payloads re-quantized "
        "from sums within one int4 step, fp32 sums within 1e-5 of the largest sum: WARN); **MISMATCH** "
        'or **ERROR** (FAIL). Payloads and dequantized values must be bitwise. Cells: "bitwise", or '
        "differing (bytes for payloads, elements otherwise) of total, the max abs difference of the "
        "(decoded) values (inf where a non-finite value meets another) and the first differing "
        "element's bits, Triton / reference.",
        "",
        *markdown_table(
            [
                "kernel",
                "output",
                "input dtype",
                "cases",
                f"bitwise = torch on {device}",
                "bitwise = torch on CPU",
                "worst verdict",
                "its case",
                f"vs torch on {device}",
                "vs torch on CPU",
            ],  # fmt: skip
            summary_rows(comparisons),
        ),
    ]
    not_bitwise = [c for c in comparisons if c.verdict != "bitwise"]
    if not_bitwise:
        lines += ["", "Every output that is not bitwise equal to both references:", ""]
        lines += markdown_table(
            [
                "kernel",
                "output",
                "input dtype",
                "case",
                f"vs torch on {device}",
                "vs torch on CPU",
                "bound",
                "verdict",
            ],  # fmt: skip
            [
                [
                    c.kernel,
                    c.output,
                    c.dtype,
                    c.case,
                    _cell(c.vs_device),
                    _cell(c.vs_cpu),
                    format_float(c.bound) if not c.strict else "0 (strict)",
                    c.verdict + (f": {c.error}" if c.error else ""),
                ]
                for c in not_bitwise
            ],  # fmt: skip
        )
    else:
        lines += ["", f"All {len(comparisons)} outputs bitwise equal to both references."]
    return SectionResult("kernels", worst_status([c.status for c in comparisons]), lines)


def _cell(d: Optional[Difference]) -> str:
    return "-" if d is None else d.cell()


def _count_bitwise(group: list[Comparison], side: str) -> str:
    checked = [getattr(c, side) for c in group if getattr(c, side) is not None]
    return f"{sum(d.bitwise for d in checked)}/{len(checked)}"


def summary_rows(comparisons: list[Comparison]) -> list[list[object]]:
    groups: dict[tuple[str, str, str], list[Comparison]] = {}
    for c in comparisons:
        groups.setdefault((c.kernel, c.output, c.dtype), []).append(c)
    rows = []
    for (kernel, output, dtype), group in groups.items():
        worst = max(group, key=lambda c: (SEVERITY[c.status], c.vs_device.differing if c.vs_device else 0))
        rows.append([kernel, output, dtype, len(group), _count_bitwise(group, "vs_device"),
                     _count_bitwise(group, "vs_cpu"), worst.verdict, worst.case, _cell(worst.vs_device),
                     _cell(worst.vs_cpu)])  # fmt: skip
    return rows


# ----------------------------------------------------------------------------------------------
# 3. Throughput


@dataclasses.dataclass
class Workload:
    """One kernel call to time: the registry field it calls, its arguments, the bytes it must move."""

    name: str
    field: str  # a QuantKernels attribute
    args: tuple[Any, ...]
    bytes_moved: int


def throughput_workloads(numel: int, device: str) -> list[Workload]:
    """The five kernels on `numel` values: int8 on 8 ranks' shards, int4 on [2 nodes, 8 local] chunks."""
    from zpp_compile.codegen import int4, quantize

    g = torch.Generator(device=device).manual_seed(0)
    ranks, block8 = 8, 256
    x = torch.randn(numel, device=device, generator=g)
    payload8 = quantize.payload_numel(numel // ranks, block8)
    payloads8 = torch.cat([quantize.quantize_packed(s, block8) for s in x.view(ranks, -1)])
    nodes, local, block4 = 2, 8, 128
    chunk = numel // (nodes * local)
    values = x.view(nodes, local, chunk)
    payload4 = int4.chunk_payload_numel(chunk, block4)
    received = int4.quantize_int4_chunks(x.view(local, nodes, chunk), block4)  # [G senders, R rows, P]
    residual_swizzled = torch.randn(local, nodes, chunk, device=device, generator=g) * 0.05
    residual_rows = torch.randn(nodes, chunk, device=device, generator=g) * 0.05
    fp32 = 4 * numel
    return [
        Workload("int8 quantize_packed, fp32 in", "quantize_packed", (x, block8), fp32 + ranks * payload8),
        Workload("int8 dequantize_packed, 8 ranks, fp32 out", "dequantize_packed",
                 (payloads8, ranks, numel // ranks, block8, torch.float32), ranks * payload8 + fp32),
        Workload("int8 dequantize_packed, 8 ranks, bf16 out", "dequantize_packed",
                 (payloads8, ranks, numel // ranks, block8, torch.bfloat16), ranks * payload8 + fp32 // 2),
        Workload("int4 quantize_swizzled [2, 8, chunk]", "int4_quantize_swizzled", (values, block4, None),
                 fp32 + local * nodes * payload4),
        Workload("int4 quantize_swizzled + error feedback", "int4_quantize_swizzled",
                 (values, block4, residual_swizzled), 3 * fp32 + local * nodes * payload4),
        Workload("int4 dequantize_reduce_requantize, 8 senders", "int4_dequantize_reduce_requantize",
                 (received, chunk, block4, None), (local + 1) * nodes * payload4),
        Workload("int4 dequantize_reduce_requantize + error feedback", "int4_dequantize_reduce_requantize",
                 (received, chunk, block4, residual_rows), (local + 1) * nodes * payload4 + 2 * nodes * chunk * 4),
        Workload("int4 dequantize_reduce, 8 senders", "int4_dequantize_reduce", (received, chunk, block4),
                 local * nodes * payload4 + nodes * chunk * 4),
    ]  # fmt: skip


class Timer:
    """Median milliseconds per call: CUDA events around `calls` back-to-back calls (so launch overhead
    hides behind the previous call's work), after warm-up; wall-clock on CPU."""

    def __init__(self, device: str, samples: int, calls: int, warmup: int = 3) -> None:
        self.device, self.samples, self.calls, self.warmup = device, samples, calls, warmup

    def median_ms(self, fn: Callable[[], object]) -> float:
        for _ in range(self.warmup):
            fn()
        if self.device != "cuda":
            return self._wall_clock_ms(fn)
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(self.samples)]  # fmt: skip
        for start, end in events:
            start.record()
            for _ in range(self.calls):
                fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) / self.calls for start, end in events)

    def _wall_clock_ms(self, fn: Callable[[], object]) -> float:
        times = []
        for _ in range(self.samples):
            t0 = time.perf_counter()
            for _ in range(self.calls):
                fn()
            times.append((time.perf_counter() - t0) * 1e3 / self.calls)
        return statistics.median(times)


def outputs_bitwise(got: Any, want: Any) -> bool:
    """Tensor or tuple outputs (None entries allowed) bitwise equal, wherever they are."""
    got_list = list(got) if isinstance(got, (tuple, list)) else [got]
    want_list = list(want) if isinstance(want, (tuple, list)) else [want]
    if len(got_list) != len(want_list):
        return False
    for g_t, w_t in zip(got_list, want_list):
        if (g_t is None) != (w_t is None) or (g_t is not None and g_t.numel() and not same_bits(g_t.cpu(), w_t.cpu())):
            return False
    return True


class CopyYardstick:
    """dst.copy_(src) of a given number of bytes, timed once per size."""

    def __init__(self, timer: Timer, device: str) -> None:
        self.timer, self.device, self.cache = timer, device, {}

    def ms(self, nbytes: int) -> float:
        if nbytes not in self.cache:
            src = torch.empty(nbytes, dtype=torch.uint8, device=self.device).random_()
            dst = torch.empty_like(src)
            self.cache[nbytes] = self.timer.median_ms(lambda: dst.copy_(src))
            del src, dst
        return self.cache[nbytes]


def throughput_section(device: str, sizes: Sizes) -> SectionResult:
    from zpp_compile.codegen.registry import kernel_set

    numel = sizes.throughput_numel
    timer = Timer(device, sizes.timing_samples, sizes.calls_per_sample)
    copy = CopyYardstick(timer, device)
    reference = kernel_set("inductor")
    implementations = {"Triton": kernel_set("triton"), "Inductor": None}  # None: torch.compile the reference
    fp32_copy_ms = copy.ms(4 * numel)
    errors = ErrorLog()
    copy_gbps = 2 * 4 * numel / fp32_copy_ms / 1e6
    failures: list[str] = []
    rows = [["copy (dst.copy_(src), fp32)", "torch", f"{fp32_copy_ms:.4f}", f"{copy_gbps:.1f}", f"{fp32_copy_ms:.4f}",
             "1.00", "-"]]  # fmt: skip
    for workload in throughput_workloads(numel, device):
        reference_fn = getattr(reference, workload.field)
        want = reference_fn(*(a.cpu() if isinstance(a, Tensor) else a for a in workload.args))  # torch on CPU
        for impl_name, kernels in implementations.items():
            try:
                fn = getattr(kernels, workload.field) if kernels else torch.compile(reference_fn, dynamic=False)
                matches = outputs_bitwise(fn(*workload.args), want)
                ms = timer.median_ms(lambda: fn(*workload.args))
                copy_ms = copy.ms(workload.bytes_moved // 2)  # a copy reads and writes: the same bytes moved
                rows.append([workload.name, impl_name, f"{ms:.4f}", f"{workload.bytes_moved / ms / 1e6:.1f}",
                             f"{copy_ms:.4f}", f"{copy_ms / ms:.2f}", "yes" if matches else "no"])  # fmt: skip
                print(f"{workload.name} [{impl_name}]: {ms:.4f} ms, {copy_ms / ms:.2f} of copy", flush=True)
            except Exception as exc:  # noqa: BLE001  (one kernel's failure is reported, the others still run)
                errors.report(f"{workload.name} [{impl_name}]", exc)
                rows.append([workload.name, impl_name, "ERROR", "-", "-", "-", "-"])
                failures.append(f"- {workload.name} [{impl_name}]: `{error_summary(exc)}`")
        del want
    timing = "CUDA events" if device == "cuda" else "wall clock (dry run: meaningless)"
    lines = [
        f"{numel} values ({4 * numel / 2**20:.0f} MiB of fp32); int8: 8 ranks' shards, block 256; int4: "
        f"[2 nodes, 8 local ranks, chunk], block 128. GB/s = (bytes read + bytes written) / time; the copy "
        f"yardstick moves the same number of bytes (reads half, writes half). Timing: {timing} around "
        f"{sizes.calls_per_sample} back-to-back calls after 3 warm-ups, median of {sizes.timing_samples} "
        f'samples. "= torch on CPU": the output bitwise equal to the reference (eager torch) on CPU copies '
        f"of the inputs.",
        "",
        *markdown_table(
            [
                "kernel",
                "implementation",
                "ms",
                "GB/s",
                "copy of the same bytes, ms",
                "fraction of copy GB/s",
                "= torch on CPU",
            ],
            rows,
        ),  # fmt: skip
    ]
    if failures:
        lines += ["", "Errors:", "", *failures]
    return SectionResult("throughput", "FAIL" if failures else "PASS", lines)


# ----------------------------------------------------------------------------------------------
# 4. Compiled training: GPU against CPU, each run in its own process


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    name: str
    config_kwargs: dict[str, bool]
    rel_tolerance: float


TRAINING_CONFIGS = (
    TrainingConfig("ZeRO-3, Config()", {}, 2e-2),
    TrainingConfig(
        "qwZ + qgZ, Config(quantize_weights=True, quantize_gradients=True)",
        {"quantize_weights": True, "quantize_gradients": True},
        5e-2,
    ),  # fmt: skip
)
TRAIN_SEED = 0
TRAIN_BATCH = 8
TRAIN_DATA_MB = 1.0
TRAIN_LR = 1e-3
GPT_SIZE = dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)
# What init_process_group() picks without a backend on a CUDA machine: nccl for CUDA tensors, gloo
# for CPU ones (shard() measures its cost model with CPU tensors).
GPU_BACKEND = "cuda:nccl,cpu:gloo"
NCCL_ONLY_PROBE_STEPS = 2


@dataclasses.dataclass(frozen=True)
class TrainingRun:
    """One training process: which config, where, on which process-group backend, compiled or not."""

    role: str  # "cpu-compiled", "cpu-eager" (the references), "measured" (the GPU), "nccl-only" (the probe)
    config_index: int
    device: str
    backend: str
    steps: int
    eager: bool = False

    @property
    def label(self) -> str:
        return f"{self.role} {self.device} config {self.config_index + 1}"

    def worker_flags(self) -> list[str]:
        flags = ["--train-worker", "--train-device", self.device, "--train-config", str(self.config_index),
                 "--train-backend", self.backend, "--steps", str(self.steps)]  # fmt: skip
        return flags + (["--train-eager"] if self.eager else [])


def train_worker_main(args: argparse.Namespace) -> int:
    """One training run (hidden --train-worker): writes {"losses", "step_seconds", ...} or {"error"}."""
    out = Path(args.result_json)
    try:
        result = train_once(args.train_device, TRAINING_CONFIGS[args.train_config], args.train_backend,
                            args.steps, eager=args.train_eager)  # fmt: skip
    except Exception as exc:  # noqa: BLE001
        traceback.print_exc()
        out.write_text(json.dumps({"error": "\n".join(failure_lines("training run", exc))}))
        return 1
    out.write_text(json.dumps(result))
    return 0


def train_once(device: str, config: TrainingConfig, backend: str, steps: int, eager: bool) -> dict[str, Any]:
    """Train examples/gpt.py's GPT on one rank through the public API only; the losses and step times."""
    import torch.distributed as dist

    import zpp_compile
    from examples.gpt import GPT, GPTConfig
    from examples.train_gpt import load_stdlib_bytes, sample_batch

    if device == "cuda":
        torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory(prefix="gpu_check_store_") as store_dir:
        dist.init_process_group(backend, init_method=f"file://{store_dir}/store", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=120))  # fmt: skip
        try:
            torch.manual_seed(TRAIN_SEED)
            model = GPT(GPTConfig(**GPT_SIZE)).to(device)  # initialised on CPU: the same weights everywhere
            data = load_stdlib_bytes(TRAIN_DATA_MB)
            gen = torch.Generator().manual_seed(TRAIN_SEED)
            batches = [sample_batch(data, TRAIN_BATCH, GPT_SIZE["block_size"], gen) for _ in range(steps)]
            with torch.no_grad():  # ground truth for step 1: the plain model, unsharded, eager, on this device
                eager_first_loss = model(*(t.to(device) for t in batches[0])).item()
            zpp_compile.shard(model, zpp_compile.Config(**config.config_kwargs))
            opt = torch.optim.AdamW(model.parameters(), lr=TRAIN_LR, weight_decay=0.1)
            run = model if eager else torch.compile(model, backend="zeropp")
            losses, step_seconds = [], []
            for step, batch in enumerate(batches, start=1):
                x, y = (t.to(device) for t in batch)
                t0 = time.perf_counter()
                loss = run(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                if device == "cuda":
                    torch.cuda.synchronize()
                losses.append(loss.item())
                step_seconds.append(time.perf_counter() - t0)
                if step == 1 or step % 10 == 0 or step == steps:
                    print(f"step {step} loss {losses[-1]:.5f} {step_seconds[-1] * 1e3:.1f} ms", flush=True)
        finally:
            dist.destroy_process_group()
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
    return {"losses": losses, "step_seconds": step_seconds, "backend": backend, "peak_memory_mib": peak,
            "eager_first_loss": eager_first_loss}  # fmt: skip


class TrainingRuns:
    """The training processes. The CPU references all start at once, in the background, when the
    check starts (they touch no GPU): for each config the compiled run and the sharded model run
    eagerly (no Inductor: the reference zpp_compile's own tests use). The GPU runs go one at a time
    (their step times are measured). Every run gets its own empty Inductor cache: its first step is
    a cold compile, and no run can load what another compiled."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu_check_training_"))
        self.on_gpu = args.device != CPU_INTERPRET
        self.references: dict[tuple[str, int], ChildProcess] = {}
        for index in range(len(TRAINING_CONFIGS)):
            for run in (self._cpu_run(index, eager=False), self._cpu_run(index, eager=True)):
                self.references[(run.role, index)] = self._start(run)

    def _cpu_run(self, index: int, eager: bool) -> TrainingRun:
        return TrainingRun("cpu-eager" if eager else "cpu-compiled", index, "cpu", "gloo", self.args.steps, eager=eager)

    def _start(self, run: TrainingRun) -> ChildProcess:
        threads = str(max(1, (os.cpu_count() or 2) // 4))
        cmd = [sys.executable, str(Path(__file__).resolve()), *run.worker_flags(),
               "--result-json", str(self._result_path(run)), *mode_flags(self.args)]  # fmt: skip
        extra = {"TORCHINDUCTOR_CACHE_DIR": str(self.tmp / f"inductor_cache_{run.role}_{run.config_index}")}
        if run.device == "cpu":
            extra.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=threads)
        return ChildProcess(cmd, child_env(self.args, **extra), prefix=f"[{run.label}] ")

    def _result_path(self, run: TrainingRun) -> Path:
        return self.tmp / f"{run.role}_{run.config_index}.json"

    def measured(self, index: int) -> dict[str, Any]:
        """The compiled run on the GPU; in the CPU dry run a third CPU run, through the same code."""
        run = TrainingRun("measured", index, "cuda" if self.on_gpu else "cpu", GPU_BACKEND if self.on_gpu else "gloo",
                          self.args.steps)  # fmt: skip
        return self._collect(run, self._start(run), GPU_TRAINING_TIMEOUT_S)

    def nccl_only(self) -> dict[str, Any]:
        """ZeRO-3 under init_process_group("nccl") alone (what many torchrun scripts pass): shard() and a
        few eager steps. (gloo in the CPU dry run.)"""
        run = TrainingRun("nccl-only", 0, "cuda" if self.on_gpu else "cpu", "nccl" if self.on_gpu else "gloo",
                          NCCL_ONLY_PROBE_STEPS, eager=True)  # fmt: skip
        return self._collect(run, self._start(run), GPU_TRAINING_TIMEOUT_S)

    def reference(self, index: int, eager: bool) -> dict[str, Any]:
        run = self._cpu_run(index, eager)
        return self._collect(run, self.references[(run.role, index)], CPU_TRAINING_TIMEOUT_S)

    def _collect(self, run: TrainingRun, child: ChildProcess, timeout_s: float) -> dict[str, Any]:
        rc = child.wait(timeout_s)
        path = self._result_path(run)
        if path.exists():
            return json.loads(path.read_text())
        why = f"killed after {timeout_s} s" if rc is None else f"exit status {rc}"
        return {"error": f"the run's process failed ({why}); its last output:\n\n```\n{child.tail_text()}\n```"}

    def close(self) -> None:
        for child in self.references.values():
            child.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)


@dataclasses.dataclass
class ConfigRuns:
    """One config's three runs (each a result dict, or {"error": ...})."""

    config: TrainingConfig
    gpu: dict[str, Any]
    cpu_compiled: dict[str, Any]
    cpu_eager: dict[str, Any]

    def named(self) -> list[tuple[str, dict[str, Any]]]:
        return [("GPU", self.gpu), ("CPU compiled", self.cpu_compiled), ("CPU eager", self.cpu_eager)]


def training_section(runs: TrainingRuns, steps: int) -> SectionResult:
    probe = runs.nccl_only()
    measured = [runs.measured(index) for index in range(len(TRAINING_CONFIGS))]  # one at a time
    results = [ConfigRuns(config, gpu, runs.reference(index, eager=False), runs.reference(index, eager=True))
               for index, (config, gpu) in enumerate(zip(TRAINING_CONFIGS, measured))]  # fmt: skip
    rows, statuses, errors = [], [], []
    for result in results:
        row, status = training_row(result)
        rows.append(row)
        statuses.append(status)
        errors += [line for name, run in result.named() if "error" in run
                   for line in (f"{result.config.name}, {name} run:", "", run["error"], "")]  # fmt: skip
    probe_status = "FAIL" if "error" in probe else "PASS"
    statuses.append(probe_status)
    lines = [
        f'World size 1, `init_process_group(backend, init_method="file://...", rank=0, world_size=1)`: '
        f"`{GPU_BACKEND}` on the GPU (what `init_process_group()` picks there without a backend), gloo on CPU. "
        f"examples/gpt.py's GPT({', '.join(f'{k}={v}' for k, v in GPT_SIZE.items())}), "
        f'`zpp_compile.shard(model, config)`, `torch.compile(model, backend="zeropp")`, AdamW(lr={TRAIN_LR}, '
        f"weight_decay=0.1), {steps} steps of {TRAIN_BATCH} x {GPT_SIZE['block_size']} tokens of stdlib "
        f"source ({TRAIN_DATA_MB} MB), seed {TRAIN_SEED}; the model is initialised on CPU, so every run "
        f"starts from the same weights and sees the same batches. Three runs per config, each a fresh "
        f"process with its own empty Inductor cache (a first step is a cold compile): on the GPU, on CPU "
        f"compiled, and on CPU with the sharded model run eagerly (no torch.compile: plain all-gather / "
        f"reduce-scatter, unquantized, the reference zpp_compile's tests use). On one rank qgZ has nothing "
        f"to exchange (its all-to-alls and int4 kernels are skipped); qwZ quantizes and dequantizes every "
        f"forward gather (the Triton kernels on the GPU, Inductor's on CPU). The verdict needs the GPU "
        f"within the tolerance of both CPU runs at every step. Step-1 column: each run's first loss and, in "
        f"brackets, its relative difference to the plain model's loss (unsharded, eager, same device and "
        f"batch) computed just before shard(). Median step: steps 6 and later.",
        "",
        *markdown_table(
            [
                "config",
                "tolerance",
                "max rel. loss diff GPU vs CPU compiled (step)",
                "GPU vs CPU eager (step)",
                "final loss GPU / CPU compiled / CPU eager",
                "step-1 loss GPU / CPU compiled (rel. to the unsharded eager model)",
                "GPU first step (compile) s",
                "GPU median step ms",
                "GPU peak memory MiB",
                "CPU compiled first step s",
                "CPU compiled median step ms",
                "verdict",
            ],
            rows,
        ),  # fmt: skip
        "",
        f'`init_process_group("nccl")` alone (no gloo for CPU tensors), ZeRO-3, shard() and '
        f"{NCCL_ONLY_PROBE_STEPS} eager steps: **{probe_status}**"
        + (f", losses {', '.join(f'{v:.4f}' for v in probe['losses'])}" if "losses" in probe else ""),
        "",
        *loss_curve_table(results, steps),
    ]
    if "error" in probe:
        errors += ["nccl-only run:", "", probe["error"], ""]
    if errors:
        lines += ["", *errors]
    return SectionResult("training", worst_status(statuses), lines)


def median_step_ms(run: dict[str, Any]) -> float:
    seconds = run["step_seconds"]
    later = seconds[5:] if len(seconds) > 5 else seconds[1:] or seconds
    return statistics.median(later) * 1e3


def max_relative_difference(gpu_losses: list[float], cpu_losses: list[float]) -> tuple[float, int]:
    """(largest |gpu - cpu| / |cpu| over the steps, its 1-based step); inf where a loss is not finite
    or the runs have different lengths."""
    if len(gpu_losses) != len(cpu_losses) or not gpu_losses:
        return math.inf, 0
    worst, worst_step = 0.0, 0
    for step, (g, c) in enumerate(zip(gpu_losses, cpu_losses), start=1):
        rel = abs(g - c) / max(abs(c), 1e-12) if math.isfinite(g) and math.isfinite(c) else math.inf
        if rel > worst or worst_step == 0:
            worst, worst_step = rel, step
    return worst, worst_step


def training_row(r: ConfigRuns) -> tuple[list[object], str]:
    tol = f"{r.config.rel_tolerance:.0e}"
    failed = [name for name, run in r.named() if "error" in run]
    gpu_times = ["-", "-", "-"] if "error" in r.gpu else _times(r.gpu, with_memory=True)
    cpu_times = ["-", "-"] if "error" in r.cpu_compiled else _times(r.cpu_compiled, with_memory=False)
    if "error" in r.gpu:
        return [r.config.name, tol, "-", "-", "-", "-", *gpu_times, *cpu_times, "FAIL (GPU run failed)"], "FAIL"
    cells, off = [], []
    for name, reference in (("CPU compiled", r.cpu_compiled), ("CPU eager", r.cpu_eager)):
        if "error" in reference:
            cells.append("- (run failed)")
            continue
        rel, step = max_relative_difference(r.gpu["losses"], reference["losses"])
        cells.append(f"{rel:.2e} (step {step})")
        if not rel <= r.config.rel_tolerance:
            off.append(name)
    finals = " / ".join(f"{run['losses'][-1]:.4f}" if "losses" in run else "-" for _, run in r.named())
    step_one = _first_step([r.gpu, r.cpu_compiled])
    problems = [f"off {name}" for name in off] + [f"{name} run failed" for name in failed]
    verdict = "PASS" if not problems else "FAIL (" + ", ".join(problems) + ")"
    row = [r.config.name, tol, *cells, finals, step_one, *gpu_times, *cpu_times, verdict]
    return row, "PASS" if not problems else "FAIL"


def _first_step(runs: list[dict[str, Any]]) -> str:
    """Each run's step-1 loss (sharded) and its relative difference to the plain model's loss on the
    same batch and device: a check that needs no other device."""
    parts = []
    for run in runs:
        if "losses" not in run:
            parts.append("-")
            continue
        first, eager = run["losses"][0], run.get("eager_first_loss")
        rel = abs(first - eager) / max(abs(eager), 1e-12) if eager is not None else math.nan
        parts.append(f"{first:.5f} ({rel:.1e})")
    return " / ".join(parts)


def _times(run: dict[str, Any], with_memory: bool) -> list[str]:
    times = [f"{run['step_seconds'][0]:.1f}", f"{median_step_ms(run):.1f}"]
    if with_memory:
        peak = run.get("peak_memory_mib")
        times.append(f"{peak:.0f}" if peak is not None else "-")
    return times


def loss_curve_table(results: list[ConfigRuns], steps: int) -> list[str]:
    shown = sorted({1, *range(5, steps + 1, 5), steps})
    header = ["step"]
    for index, result in enumerate(results, start=1):
        header += [f"config {index} {name}" for name, _ in result.named()]
    rows = []
    for step in shown:
        row: list[object] = [step]
        for result in results:
            for _, run in result.named():
                losses = run.get("losses", [])
                row.append(f"{losses[step - 1]:.5f}" if step <= len(losses) else "-")
        rows.append(row)
    names = "; ".join(f"config {i}: {r.config.name}" for i, r in enumerate(results, start=1))
    return [f"Losses ({names}):", "", *markdown_table(header, rows)]


# ----------------------------------------------------------------------------------------------
# Orchestration


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smaller sizes in sections 2 and 3")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma list of {', '.join(SECTIONS)} (or 1-4); default: all")  # fmt: skip
    p.add_argument("--steps", type=int, default=30, help="training steps per run in section 4")
    p.add_argument("--out", default=None, help=f"markdown report (default: {DEFAULT_OUT.relative_to(ROOT)})")
    p.add_argument("--device", default="cuda", choices=["cuda", CPU_INTERPRET],
                   help="cpu-interpret: developer-only dry run on CPU (Triton interpreter); see above")  # fmt: skip
    # Hidden: the child processes this script starts.
    p.add_argument("--child-section", choices=["kernels", "throughput"], help=argparse.SUPPRESS)
    p.add_argument("--train-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--train-device", choices=["cuda", "cpu"], help=argparse.SUPPRESS)
    p.add_argument("--train-config", type=int, help=argparse.SUPPRESS)
    p.add_argument("--train-backend", help=argparse.SUPPRESS)
    p.add_argument("--train-eager", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result-json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    return args


def selected_sections(spec: str) -> list[str]:
    chosen = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        name = SECTIONS[int(item) - 1] if item.isdigit() and 1 <= int(item) <= len(SECTIONS) else item
        if name not in SECTIONS:
            raise SystemExit(f"--sections: unknown section {item!r}; choose from {', '.join(SECTIONS)} or 1-4")
        if name not in chosen:
            chosen.append(name)
    return [name for name in SECTIONS if name in chosen]


def run_section(name: str, args: argparse.Namespace, training: Optional[TrainingRuns]) -> SectionResult:
    print(f"\n=== {SECTION_TITLES[name]} ===", flush=True)
    if name == "env":
        return run_guarded(name, lambda: environment_section(args))
    if name == "training":
        assert training is not None
        return run_guarded(name, lambda: training_section(training, args.steps))
    start = time.monotonic()
    result = run_section_in_child(name, args)
    result.seconds = time.monotonic() - start
    return result


def report(results: list[SectionResult], command: str, started: datetime.datetime, wall_s: float,
           args: argparse.Namespace) -> str:  # fmt: skip
    overall = worst_status([r.status for r in results])
    dry_run = " (developer dry run on CPU: `--device cpu-interpret`, numbers meaningless)"
    summary = [[SECTION_TITLES[r.name], r.status, f"{r.seconds:.0f}"] for r in results]
    lines = [
        f"Command: `{command}`",
        "",
        f"Run {started.strftime('%Y-%m-%d %H:%M UTC')}, {wall_s:.0f} s in all; overall **{overall}**"
        + (dry_run if args.device == CPU_INTERPRET else ""),
        "",
        *markdown_table(["section", "status", "seconds"], summary),
    ]  # fmt: skip
    for r in results:
        lines += ["", f"## {SECTION_TITLES[r.name]}: {r.status}", "", *r.lines]
    return "\n".join(lines)


def orchestrate(args: argparse.Namespace) -> int:
    if args.device != CPU_INTERPRET and not torch.cuda.is_available():
        print(SKIP_MESSAGE)
        return 0
    sections = selected_sections(args.sections)
    command = "python benchmarks/gpu_check.py" + "".join(f" {shlex.quote(a)}" for a in sys.argv[1:])
    started, t0 = datetime.datetime.now(datetime.timezone.utc), time.monotonic()
    training = TrainingRuns(args) if "training" in sections else None  # CPU references start now
    try:
        results = [run_section(name, args, training) for name in sections]
    finally:
        if training is not None:
            training.close()
    text = report(results, command, started, time.monotonic() - t0, args)
    print("\n" + text)
    out = Path(args.out) if args.out else (None if args.device == CPU_INTERPRET else DEFAULT_OUT)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("# GPU readiness check\n\n" + text + "\n")
        print(f"\nwritten to {out}")
    failed = [r.name for r in results if r.status == "FAIL"]
    print(f"gpu_check: {'FAIL in ' + ', '.join(failed) if failed else 'all sections passed'}")
    return 1 if failed else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.child_section:
        return child_section_main(args)
    if args.train_worker:
        return train_worker_main(args)
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
