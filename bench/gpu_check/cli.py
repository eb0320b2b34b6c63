"""`python -m bench.gpu_check`: the flags, and the parts run in order within the check's time budget."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from bench.gpu_check.agreement import compare_greedy, seeded_sampling_part, write_tiny_pair
from bench.gpu_check.attention import flash_part
from bench.gpu_check.batch_invariance import batch_invariance
from bench.gpu_check.diffusion_gemma import diffusion_gemma, write_release_config
from bench.gpu_check.engine_choice import EngineChoice, parse_override
from bench.gpu_check.machine import machine_report
from bench.gpu_check.random_weights import write_config_only
from bench.gpu_check.settings import PAGE, SDAR_1_7B, SDAR_4B, TRAFFIC
from bench.gpu_check.throughput import shape_throughput, throughput, write_sdar
from bench.gpu_check.trajectory import trajectory_scoring

PARTS = ("machine", "flash", "greedy", "seeded_sampling", "throughput", "float32_reference", "sdar_4b",
         "batch_invariance", "trajectory_scoring", "diffusion_gemma")
MODEL_PARTS = {"throughput", "float32_reference", "sdar_4b", "batch_invariance", "trajectory_scoring",
               "diffusion_gemma"}
# One command on the borrowed machine may run 600 s: the parts' budget leaves room for the final report.
BUDGET_SECONDS = 560.0
TRAJECTORY_CAP_SECONDS = 90.0  # 64 x 256 rollouts and their scoring on the SDAR-1.7B shape, with the engine's build
# DiffusionGemma's release shape on two backends: builds, warm-ups (a compile) and 45 s runs at 1 and 32
DIFFUSION_GEMMA_CAP_SECONDS = 330.0


def write_json(path: Path, value: dict) -> None:
    """`value` as indented JSON at `path`, its folder made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=2) + "\n")


class PartLoop:
    """Runs the selected parts: each prints its JSON line as soon as it finishes (a later part's crash or
    timeout keeps the earlier ones), and with an `out_dir` writes it to `out_dir/<part>.json` too, and is
    recorded in `report`; a part that raises reports its error and the others still run."""

    def __init__(self, selected: set[str], budget: float = BUDGET_SECONDS, out_dir: Path | None = None):
        self.selected, self.budget, self.out_dir = selected, budget, out_dir
        self.report: dict = {}
        self.t0 = time.perf_counter()

    def __call__(self, name: str, check: Callable[[], dict], cap: float | None = None) -> None:
        """Run part `name` if selected. A part with a `cap` (the seconds it may take) starts only while the
        cap fits in what is left of the budget; otherwise it reports itself skipped."""
        if name not in self.selected:
            return
        started = time.perf_counter()
        left = self.budget - (started - self.t0)
        if cap is not None and cap > left:
            self.report[name] = {"skipped": f"its {cap:.0f} s cap exceeds the {max(left, 0):.0f} s left of the "
                                            f"check's {self.budget:.0f} s budget"}
        else:
            try:
                self.report[name] = check()
            except Exception as exc:  # noqa: BLE001 -- one failing part must not hide the others' results
                self.report[name] = {"error": f"{type(exc).__name__}: {exc}"}
        self.report[name]["part_seconds"] = time.perf_counter() - started
        print(json.dumps({name: self.report[name]}), flush=True)
        if self.out_dir is not None:
            write_json(self.out_dir / f"{name}.json", self.report[name])

    def finish(self) -> dict:
        """The whole report, with the check's seconds: printed, and written to `out_dir/report.json`."""
        self.report["seconds"] = time.perf_counter() - self.t0
        print(json.dumps(self.report, indent=2))
        if self.out_dir is not None:
            write_json(self.out_dir / "report.json", self.report)
        return self.report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check",
                                     description=sys.modules[__package__].__doc__.splitlines()[0])
    parser.add_argument("--skip-throughput", action="store_true", help="leave out the large-model parts")
    parser.add_argument("--only", nargs="+", choices=PARTS, help="run these parts alone")
    parser.add_argument("--attention", default="auto", choices=["auto", "torch", "flash", "flex", "triton"],
                        help="the model parts' attention backend")
    parser.add_argument("--kv-block-size", type=int, default=PAGE,
                        help="the model parts' KV page size (torch's own flash kernel needs 256)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="the model parts without CUDA graphs")
    parser.add_argument("--set", action="append", type=parse_override, default=[], metavar="FIELD=VALUE",
                        help="an EngineConfig field for every model part, applied last; VALUE is read as JSON, "
                             "else as a string (repeatable; e.g. --set enable_torch_compile=true)")
    parser.add_argument("--throughput-seconds", type=float, default=240.0, metavar="S",
                        help="the throughput part starts no new concurrency after S seconds (default 240)")
    parser.add_argument("--diffusion-gemma-seconds", type=float, default=45.0, metavar="S",
                        help="each DiffusionGemma run (one backend, one concurrency) stops after S seconds "
                             "(default 45)")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help="also write each part's JSON to DIR/<part>.json as it finishes and the whole report "
                             "to DIR/report.json (DIR is made if missing)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    choice = EngineChoice(args.attention, args.kv_block_size, not args.no_cuda_graphs, dict(args.set))
    if not torch.cuda.is_available():
        skipped = {"skipped": "no CUDA device: the GPU check runs only where torch.cuda.is_available()",
                   "machine": machine_report()}
        print(json.dumps(skipped))
        if args.out is not None:
            write_json(args.out / "report.json", skipped)
        return 0
    part = PartLoop(set(args.only or PARTS) - (MODEL_PARTS if args.skip_throughput else set()), out_dir=args.out)
    part.report["card"] = torch.cuda.get_device_name()
    part.report["engine_choice"] = asdict(choice)
    part("machine", machine_report)
    part("flash", lambda: flash_part(torch.device("cuda"), torch.bfloat16))
    with tempfile.TemporaryDirectory() as tmp:
        tiny = write_tiny_pair(Path(tmp))
        part("greedy", lambda: compare_greedy(tiny, "cuda"))
        # every backend that can serve seeded requests here: compiled flex was not batch-invariant on an H200
        part("seeded_sampling", lambda: seeded_sampling_part(tiny, "cuda", "bfloat16"))
        if part.selected & {"throughput", "float32_reference"}:
            path = write_sdar(Path(tmp), SDAR_1_7B)
            part("throughput", lambda: throughput(path, SDAR_1_7B, "cuda", "bfloat16", [1, 32, 128], TRAFFIC,
                                                  hf_requests=4, max_seconds=args.throughput_seconds,
                                                  choice=choice))
            part("float32_reference", lambda: throughput(path, SDAR_1_7B, "cuda", "float32", [1], TRAFFIC,
                                                         hf_requests=4, max_seconds=60, choice=choice))
        part("sdar_4b", lambda: shape_throughput(write_config_only(Path(tmp), SDAR_4B), SDAR_4B, "cuda", "bfloat16",
                                                 128, TRAFFIC, choice=choice))
        part("batch_invariance", lambda: batch_invariance(write_config_only(Path(tmp), SDAR_1_7B), SDAR_1_7B, "cuda",
                                                          "bfloat16", 128, TRAFFIC, choice=choice))
        part("trajectory_scoring", lambda: trajectory_scoring(write_config_only(Path(tmp), SDAR_1_7B), "cuda",
                                                              "bfloat16", choice=choice),
             cap=TRAJECTORY_CAP_SECONDS)
        part("diffusion_gemma", lambda: diffusion_gemma(write_release_config(Path(tmp)), "cuda", "bfloat16", choice,
                                                        max_seconds=args.diffusion_gemma_seconds),
             cap=DIFFUSION_GEMMA_CAP_SECONDS)
    part.finish()
    return 0
