"""`python -m bench.paired --base DIR [--rounds N] [--fields NAME[,NAME]] -- MODULE [ARGS...]`: a bench
of this checkout and of another one (the baseline: a `git worktree` of an older revision, say) run at the
same time, one on each of two CPU cores, the cores swapped every round.

On a shared machine the speed of the moment moves a figure by tens of per cent from one run to the next,
more than most changes move it, so runs taken one after the other compare the machine as much as the
code. Two runs side by side meet the same moment: the ratio of their figures, round by round, is what
the change did (a machine whose two cores differ shows in the rounds before and after a swap).
`MODULE` is a bench module's name under `bench` (`overhead`), run as `python -m bench.MODULE ARGS` in
each checkout with that checkout on `PYTHONPATH`; it must print one JSON object. Prints one JSON object:
per numeric figure both sides printed (its path joined with `/`; `--fields` keeps the paths that
contain one of the names given), each side's value per round, the ratio this / base per round, the
geometric mean of the ratios (take an even number of rounds: each core then serves each side equally
often, and a core's own speed cancels in it) and their median (which one disturbed round moves less).
`--runs` adds each side's whole output per round. Where this checkout's bench prints figures the
baseline's does not (a new field), copy the bench file into the baseline's worktree: a figure one side
lacks is left out of the comparison.

    git worktree add /tmp/base <revision>
    PYTHONPATH=. python -m bench.paired --base /tmp/base --fields overhead_us_per_seq_step_median,phase_us \\
        -- overhead --paradigms --only ar --unary --no-stop-strings
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

THIS = Path(__file__).resolve().parent.parent


def numeric_leaves(value: object, path: str = "") -> dict[str, float]:
    """Every number in a JSON value (booleans are not numbers here), by its path of keys and indices."""
    if isinstance(value, bool):
        return {}
    if isinstance(value, int | float):
        return {path: value}
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    out: dict[str, float] = {}
    for key, inner in items:
        out.update(numeric_leaves(inner, f"{path}/{key}" if path else str(key)))
    return out


def _start(checkout: Path, module: str, args: list[str], core: int | None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    pin = None if core is None else (lambda: os.sched_setaffinity(0, {core}))
    return subprocess.Popen([sys.executable, "-m", f"bench.{module}", *args], cwd=checkout, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=pin)


def _output(proc: subprocess.Popen, side: str) -> dict:
    out, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"the {side} side's bench failed ({proc.returncode}):\n{err[-2000:]}")
    return json.loads(out)


def run_pairs(base: Path, module: str, args: list[str], rounds: int) -> tuple[list[dict], list[int] | None]:
    """Each round's outputs, {"base": ..., "this": ...}, and the two cores used (None: not pinned, where
    this process may use fewer than two)."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores = allowed[:2] if len(allowed) >= 2 else None
    runs = []
    for i in range(rounds):
        base_core, this_core = (None, None) if cores is None else (cores[i % 2], cores[1 - i % 2])
        print(f"[paired] round {i + 1}/{rounds}: base on core {base_core}, this on core {this_core}",
              file=sys.stderr, flush=True)
        procs = {"base": _start(base, module, args, base_core), "this": _start(THIS, module, args, this_core)}
        try:
            runs.append({side: _output(proc, side) for side, proc in procs.items()})
        finally:  # one side failed: the other is not left running on its core
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    return runs, cores


def ratios(runs: list[dict], fields: list[str] | None) -> dict[str, dict]:
    """Per numeric figure both sides printed every round: the values per round, this / base per round
    (None where the base value is 0), the geometric mean of the ratios (over an even number of rounds a
    faster core's factor appears once on each side of the ratio and cancels; None unless every ratio is
    above 0) and their median (which one round disturbed by something else on the machine moves less)."""
    leaves = [{side: numeric_leaves(run[side]) for side in ("base", "this")} for run in runs]
    paths = set.intersection(*(set(run["base"]) & set(run["this"]) for run in leaves))
    if fields:
        paths = {p for p in paths if any(name in p for name in fields)}
    out = {}
    for path in sorted(paths):
        base = [run["base"][path] for run in leaves]
        this = [run["this"][path] for run in leaves]
        per_round = [t / b if b else None for b, t in zip(base, this)]
        known = [r for r in per_round if r is not None]
        positive = known and min(known) > 0  # a geometric mean needs every ratio above 0
        out[path] = {"base": base, "this": this, "ratio": [None if r is None else round(r, 4) for r in per_round],
                     "ratio_geometric_mean": round(statistics.geometric_mean(known), 4) if positive else None,
                     "ratio_median": round(statistics.median(known), 4) if known else None}
    return out


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 usage="python -m bench.paired --base DIR [--rounds N] [--fields ...] -- MODULE [ARGS]")
    ap.add_argument("--base", required=True, type=Path, help="the baseline checkout (its bench/ runs there)")
    ap.add_argument("--rounds", type=int, default=4,
                    help="pairs of runs, cores swapped each round (default 4; even, so each core serves each side "
                         "equally often)")
    ap.add_argument("--fields", default=None, metavar="NAME[,NAME]",
                    help="compare only the figures whose path contains one of these names")
    ap.add_argument("--runs", action="store_true", help="also print each side's whole output per round")
    if "-h" in argv or "--help" in argv:  # anywhere, the bench's arguments included: this help
        ap.parse_args(["--help"])
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    bench = argv[cut + 1:]
    if not bench:
        ap.error("name the bench after --, e.g. -- overhead --paradigms --only ar")
    if not (args.base / "bench" / f"{bench[0]}.py").exists() and not (args.base / "bench" / bench[0]).is_dir():
        raise SystemExit(f"--base {args.base}: no bench/{bench[0]} there; pass a checkout of this project")
    runs, cores = run_pairs(args.base.resolve(), bench[0], bench[1:], args.rounds)
    fields = [f.strip() for f in args.fields.split(",") if f.strip()] if args.fields else None
    out = {"command": "python -m bench.paired " + " ".join(argv), "base": str(args.base), "rounds": args.rounds,
           "cores": cores, "figures": ratios(runs, fields), **({"runs": runs} if args.runs else {})}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
