"""`python -m bench.gpu_check.collect DIR`: the runs of bench/gpu_check/device_run.sh gathered into
DIR/summary.json, one file that holds every run's exit code and report (the borrowed machine hands back
only a few files of its output folder)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

STDERR_TAIL_LINES = 40


def read_exit_codes(path: Path) -> dict[str, dict]:
    """DIR/exit_codes.txt's lines, `RUN EXIT_CODE SECONDS CAP_S` (EXIT_CODE 124: timed out; `skipped`:
    no time was left for the run), by run."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            name, code, seconds, cap = line.split()
            out[name] = {"exit_code": int(code) if code.lstrip("-").isdigit() else code, "seconds": int(seconds),
                         "cap_s": int(cap)}
    return out


def read_run(folder: Path) -> dict:
    """One run's report: its report.json where the run finished, else the parts' JSON files it wrote
    before it stopped; and the last lines of its stderr (the progress log, and a traceback if any)."""
    report = folder / "report.json"
    parts = {p.stem: _load(p) for p in sorted(folder.glob("*.json")) if p != report}
    stderr = folder / "stderr.log"
    tail = stderr.read_text(errors="replace").replace("\r", "\n").splitlines()[-STDERR_TAIL_LINES:] \
        if stderr.exists() else []
    return {"finished": report.exists(), "report": _load(report) if report.exists() else parts,
            "stderr_tail": [line[:300] for line in tail]}


def _load(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # a file cut short by a timeout
        return {"unreadable": f"{type(exc).__name__}: {exc}"}


def collect(out_dir: Path) -> dict:
    """Every run folder under `out_dir` with its exit code."""
    codes = read_exit_codes(out_dir / "exit_codes.txt")
    runs = {p.name: read_run(p) for p in sorted(out_dir.iterdir()) if p.is_dir()}
    return {name: {**codes.get(name, {}), **runs.get(name, {})} for name in sorted(codes.keys() | runs.keys())}


def main(argv: list[str] | None = None) -> int:
    out_dir = Path((argv or sys.argv[1:])[0])
    summary = collect(out_dir)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for name, run in summary.items():
        print(name, "exit", run.get("exit_code"), "after", run.get("seconds"), "s;", "finished" if run.get("finished")
              else "unfinished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
