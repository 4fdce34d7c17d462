"""Config(plan="auto") against every hand-picked ZeRO++ configuration, on the two-node cluster.

    sudo python benchmarks/auto_plan.py [--rates 100mbit,1gbit,none] [--steps 5]

Runs benchmarks/cluster.py's two simulated nodes (2 ranks each, a tbf-limited veth between them)
at each link rate, with a fresh Inductor cache per rate so that the cost model measures each link
(it would otherwise keep rates remembered from a link within 4x). Every config trains the same GPT
in the same processes, timed round-robin. Reports, per rate: each config's median step; what the
automatic plan chose, its estimated and measured bytes against the budget; auto's step against
the best hand-picked config (lossless ones for plan="auto", all for allow_lossy=True); and how
close the automatic plan gets to the link's physical limit:
  * 1 Gbit: its step against its own step on the unshaped link;
  * 100 Mbit: its step against max(its unshaped step, link bytes one way / 12.5 MB/s);
and the same two against the unshaped step of the hand-picked config with the techniques it chose
(the plan's own compute floor where the unshaped link got another plan).
`--from-raw` rewrites the doc from a run's saved measurements (--raw).
Writes docs/auto_plan.md and, with matplotlib, docs/auto_plan.png.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.cluster import measure_rates, plot  # noqa: E402
from benchmarks.cluster_worker import CONFIGS  # noqa: E402
from zpp_compile.auto_plan import Techniques  # noqa: E402
from zpp_compile.config import Config  # noqa: E402

LOSSLESS = (
    "zeropp ZeRO-3",
    "zeropp + qwZ",
    "zeropp + hpZ",
    "zeropp qwZ+hpZ",
    "zeropp + hier. reduce",
    "zeropp qwZ+hpZ+hier. reduce",
    "zeropp qwZ+hpZ+hier.",
)
LOSSY = ("zeropp + qgZ", "zeropp qwZ+hpZ+qgZ", "zeropp qwZ+hpZ+qgZ+hier. gather")
AUTO = {
    "zeropp auto": LOSSLESS,
    "zeropp auto lossy": LOSSLESS + LOSSY,
    "zeropp auto timed": LOSSLESS,
    "zeropp auto lossy timed": LOSSLESS + LOSSY,
}
LINK_BYTES_PER_S = {"100mbit": 100e6 / 8, "1gbit": 1e9 / 8}


def best(configs: dict, names: tuple[str, ...]) -> tuple[str, float]:
    name = min(names, key=lambda n: configs[n]["step_s"])
    return name, configs[name]["step_s"]


def limit_ratio(results: dict, rate: str, auto: str, unshaped_step: Optional[float] = None) -> Optional[float]:
    """The step at `rate` against the physical limit (module docstring), with the unshaped link's
    step `unshaped_step` (default: the automatic plan's own there); None without the data."""
    unshaped = results.get("unshaped", {}).get(auto)
    here = results.get(rate, {}).get(auto)
    if unshaped is None or here is None or rate not in LINK_BYTES_PER_S:
        return None
    floor = unshaped["step_s"] if unshaped_step is None else unshaped_step
    if rate == "1gbit":
        return here["step_s"] / floor
    one_way = here["link_bytes"] / 2 / LINK_BYTES_PER_S[rate]
    return here["step_s"] / max(floor, one_way)


def same_plan_unshaped_step(results: dict, rate: str, auto: str) -> Optional[tuple[str, float]]:
    """(name, unshaped step) of the hand-picked config with the techniques the automatic plan chose
    at `rate` (its bucket cap, prefetch depth, kept-whole parameters and hpZ's secondary dtype may
    differ): the plan's own compute floor, where the automatic plan chose otherwise on the unshaped
    link. None: no such config was run."""
    chosen = results.get(rate, {}).get(auto, {}).get("plan", "").split(",")[0].replace("hpZ int8", "hpZ")
    unshaped = results.get("unshaped", {})
    for name in (*LOSSLESS, *LOSSY):
        if name in unshaped and techniques_of(CONFIGS[name][1]).name == chosen:
            return name, unshaped[name]["step_s"]
    return None


def techniques_of(options: dict) -> Techniques:
    """The automatic plan's techniques that a hand-picked config of cluster_worker.py runs, but for
    hpZ's secondary dtype (hpz_int8 left False)."""
    config = Config(**options)
    return Techniques(
        quantize_weights=config.quantize_weights,
        hpz=config.hpz_enabled,
        quantize_gradients=config.quantize_gradients,
        hierarchical_reduce=config.hierarchical_reduce and not config.quantize_gradients,
        hierarchical_gather=config.hierarchical_gather,
    )


def table(results: dict, command: str) -> str:
    mb = 1e6
    lines = [
        f"`{command}` (GPT 3.3M params, 4 ranks = 2 namespaces x 2, gloo over a tbf-limited veth; medians of "
        "round-robin steps after warm-up; step = slowest rank; a fresh Inductor cache per rate)",
        "",
        "| link | plan | chose | step ms | best hand-picked | its step ms | auto / best | estimated MB | "
        "measured MB | budget MB | physical-limit ratio | the same against its techniques' unshaped step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for rate, configs in results.items():
        for auto, candidates in AUTO.items():
            if auto not in configs:
                continue
            r = configs[auto]
            name, step = best(configs, tuple(c for c in candidates if c in configs))
            ratio = limit_ratio(results, rate, auto)
            twin = same_plan_unshaped_step(results, rate, auto)
            twin_ratio = None if twin is None else limit_ratio(results, rate, auto, twin[1])
            lines.append(
                f"| {rate} | {auto} | {r.get('plan', '-')} | {r['step_s'] * 1e3:.0f} | {name} | {step * 1e3:.0f} | "
                f"{r['step_s'] / step:.2f} | {r.get('plan_estimated_bytes', 0) / mb:.1f} | "
                f"{r.get('plan_measured_bytes', 0) / mb:.1f} | {r.get('budget_bytes', 0) / mb:.0f} | "
                f"{_ratio(ratio)} | {'-' if twin_ratio is None else f'{twin_ratio:.2f} ({twin[0]})'} |"
            )
    lines += ["", "Every config's step (ms):", ""]
    names = list(next(iter(results.values())))
    lines += ["| config | " + " | ".join(results) + " |", "| --- |" + " --- |" * len(results)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{results[r][name]['step_s'] * 1e3:.0f}" for r in results) + " |")
    return "\n".join(lines)


def _ratio(ratio: Optional[float]) -> str:
    return "-" if ratio is None else f"{ratio:.2f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="100mbit,1gbit,none", help="tc rates, 'none' for an unshaped link")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--timeout", type=float, default=3600, help="seconds per link rate")
    p.add_argument("--raw", default="/tmp/zpp_auto_plan_results.json", help="where the measurements go as JSON")
    p.add_argument("--from-raw", action="store_true", help="rewrite the doc from --raw's measurements, run nothing")
    args = p.parse_args()
    if args.from_raw:
        results = json.loads(Path(args.raw).read_text())
    else:
        rates = [None if r == "none" else r for r in args.rates.split(",")]
        configs = ",".join((*LOSSLESS, *LOSSY, *AUTO))
        results = measure_rates(rates, args.steps, configs, args.timeout, cache_per_rate=True)
        Path(args.raw).write_text(json.dumps(results, indent=1))
    text = table(results, f"sudo python benchmarks/auto_plan.py --rates {args.rates} --steps {args.steps}")
    if plot(results, ROOT / "docs" / "auto_plan.png"):
        text += "\n\n![step time against link rate](auto_plan.png)"
    print(text)
    doc = ROOT / "docs" / "auto_plan.md"
    hand_written = _hand_written(doc)
    doc.write_text('# Config(plan="auto"): measured\n\n' + text + "\n" + hand_written)


def _hand_written(doc: Path) -> str:
    """The doc's section after '## How the plan is chosen' (kept across runs)."""
    if not doc.exists():
        return ""
    text = doc.read_text()
    start = text.find("\n## How the plan is chosen")
    return text[start:] if start >= 0 else ""


if __name__ == "__main__":
    main()
