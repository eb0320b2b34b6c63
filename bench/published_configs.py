"""What loading a published configuration costs: reduced-depth random checkpoints of the releases in
tools/published_checkpoints.py (exact tensor names and shapes, bfloat16 safetensors shards), each
loaded by a fresh process into the engine; prints one JSON line per release: the checkpoint's size,
the seconds to build the engine (read, check, place every tensor, allocate the KV cache), the
process's peak resident memory, and one short greedy generation (its tokens are random: the weights are).

    python -m bench.published_configs [--layers 2] [--only NAME ...] [--dtype float32|bfloat16] [--workdir DIR]

The engine loads in float32 by default (the CPU default); `--dtype bfloat16` keeps the checkpoint's
precision, halving the resident weights (what a machine too small for a release in float32 needs).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.published_checkpoints import PUBLISHED, write_published


def load_once(path: str, dtype: str) -> dict:
    """In this process: build the engine on `path` in `dtype`, generate 8 tokens; the figures."""
    from configs import EngineConfig, GenerationConfig
    from engine.offline import pipeline

    t0 = time.perf_counter()
    pipe = pipeline(path, EngineConfig(max_model_len=256, num_kv_blocks=64, max_batch_size=4, dtype=dtype))
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    out = pipe([1, 2, 3, 4, 5], GenerationConfig(max_new_tokens=8))
    generate_s = time.perf_counter() - t1
    pipe.close()
    return {"load_s": round(load_s, 2), "generate_8_s": round(generate_s, 2), "tokens": len(out.token_ids),
            "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers kept (LLaDA2: the dense one + MoE)")
    parser.add_argument("--only", nargs="*", default=None, help=f"releases (default all: {', '.join(PUBLISHED)})")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the engine's weights and activations (default float32)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--load", default=None, help=argparse.SUPPRESS)  # the child process's part
    args = parser.parse_args(argv)
    if args.load:
        print(json.dumps(load_once(args.load, args.dtype)))
        return
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench-published-"))
    for name in args.only or list(PUBLISHED):
        t0 = time.perf_counter()
        path = write_published(name, root / name, args.layers)
        write_s = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        child = subprocess.run([sys.executable, "-m", "bench.published_configs", "--load", str(path),
                                "--dtype", args.dtype],
                               capture_output=True, text=True, check=True)
        print(json.dumps({"release": name, "layers": args.layers, "dtype": args.dtype,
                          "checkpoint_gb": round(size / 1e9, 2), "write_s": round(write_s, 1),
                          **json.loads(child.stdout.strip().splitlines()[-1])}),
              flush=True)


if __name__ == "__main__":
    main()
