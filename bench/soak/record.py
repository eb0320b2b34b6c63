"""What a soak run writes: one JSON line per iteration (soak.jsonl), a PNG per series, the summary
with its verdicts (summary.json, also printed), and a progress line on stderr."""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from bench.soak.loop import Iteration
from bench.soak.verdict import leaks

SERIES = ("rss_mb", "anon_mb", "gpu_mb", "fds", "threads")


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if len(values) < 2:
        return dict.fromkeys(("p50", "p90", "p99"), values[0] if values else None)
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": q[49], "p90": q[89], "p99": q[98]}


def iteration_record(it: Iteration, seconds: float, procs: dict[str, dict[str, float]],
                     pages: dict[str, float]) -> dict[str, Any]:
    """The JSON line of one iteration: its endings, problems, latencies, pages and processes."""
    endings: Counter[str] = Counter()
    lost, unexpected = 0, []
    for outcome, allowed in it.outcomes:
        for ending in outcome.endings:
            endings[ending] += 1
            if ending == "lost":
                lost += 1
            elif ending not in allowed:
                unexpected.append(f"{outcome.kind}: {ending}")
    mismatches = [p for o, _ in it.outcomes for p in o.problems]
    errors = [e for o, _ in it.outcomes for e in o.errors]
    latency = [o.latency_s for o, _ in it.outcomes if o.kind in ("rollout", "rollout_stream", "score")]
    return {"iteration": it.index, "time": time.time(), "seconds": seconds, "update": it.update,
            "version": it.version, "requests": sum(len(o.endings) for o, _ in it.outcomes),
            "endings": dict(endings), "lost": lost, "unexpected": unexpected, "errors": errors,
            "version_problems": mismatches, "problems": it.problems, "faults": it.faults,
            "spanned_update": it.spanned, "latency_s": _percentiles(latency),
            "pages": pages, "procs": procs}


def _drift(latency: dict[str, list[float]]) -> dict[str, float | None]:
    """The median over iterations of each iteration's p50 and p99, over the whole run and over its
    first and last quarter (latency that drifts shows as a last quarter above the first)."""
    out: dict[str, float | None] = {}
    for q, values in latency.items():
        quarter = max(len(values) // 4, 1)
        for part, vs in (("all", values), ("first_quarter", values[:quarter]), ("last_quarter", values[-quarter:])):
            out[f"{q}_{part}"] = statistics.median(vs) if vs else None
    return out


class Recorder:
    def __init__(self, out: Path, leak_limit_mb: float, total: int | None):
        self.out, self.leak_limit_mb, self.total = out, leak_limit_mb, total
        out.mkdir(parents=True, exist_ok=True)
        self.lines = (out / "soak.jsonl").open("w")
        self.records: list[dict[str, Any]] = []
        self.started = time.monotonic()

    def add(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self.lines.write(json.dumps(record) + "\n")
        self.lines.flush()
        self._progress(record)

    def _progress(self, r: dict[str, Any]) -> None:
        done = len(self.records)
        rate = done / max(time.monotonic() - self.started, 1e-9) * 60
        engine = sum(p["rss_mb"] for k, p in r["procs"].items() if k.startswith(("engine", "tp_worker")))
        of = f"/{self.total}" if self.total else ""
        lost = sum(x["lost"] for x in self.records)
        bad = sum(len(x["version_problems"]) + len(x["unexpected"]) + len(x["problems"]) for x in self.records)
        print(f"\r[soak] {done}{of} iterations  {rate:.1f}/min  engine rss {engine:.0f} MB  lost {lost}  "
              f"problems {bad}   ", end="", file=sys.stderr, flush=True)

    def series(self) -> dict[str, dict[str, list[float]]]:
        """metric -> `role:pid` -> its value per iteration (from the process's first sample on)."""
        out: dict[str, dict[str, list[float]]] = {m: {} for m in SERIES}
        for r in self.records:
            for proc, values in r["procs"].items():
                for m in SERIES:
                    out[m].setdefault(proc, []).append(values[m])
        out["free_pages"] = {}
        for r in self.records:
            for key, value in r["pages"].items():
                if key.startswith("free"):
                    out["free_pages"].setdefault(key, []).append(value)
        out["latency_s"] = {q: [r["latency_s"][q] or 0.0 for r in self.records] for q in ("p50", "p99")}
        return out

    def summary(self) -> dict[str, Any]:
        series = self.series()
        trends, leaking, settling = {}, [], []
        # A process that is gone by the end (killed by a fault drill, replaced) is not judged: it died
        # while still warming up, and its replacement is a series of its own.
        alive = set(self.records[-1]["procs"]) if self.records else set()
        for metric in ("rss_mb", "anon_mb"):
            for proc, values in series[metric].items():
                if proc not in alive:
                    trends[f"{metric}:{proc}"] = {"points": len(values), "ended_early": True}
                    continue
                leak, t = leaks(values, self.leak_limit_mb)
                trends[f"{metric}:{proc}"] = {"warmup": t.warmup, "points": t.points, "settling": t.settling,
                                              "mb_per_200": None if t.slope is None else t.slope * 200}
                if leak is None:
                    settling.append(f"{metric} of {proc}")
                elif leak:
                    leaking.append(f"{metric} of {proc}: +{t.slope * 200:.1f} MB per 200 iterations after "
                                   f"{t.warmup} iterations of warm-up")
        pages_short = [f"iteration {r['iteration']}: {k} = {v} of {r['pages'].get(k.replace('free', 'total'))}"
                       for r in self.records for k, v in r["pages"].items()
                       if k.startswith("free") and v != r["pages"].get(k.replace("free", "total"))]
        out = {
            "iterations": len(self.records), "minutes": (time.monotonic() - self.started) / 60,
            "requests": sum(r["requests"] for r in self.records),
            "spanned_update": sum(r.get("spanned_update", 0) for r in self.records),
            "lost": sum(r["lost"] for r in self.records),
            "version_problems": [p for r in self.records for p in r["version_problems"]],
            "unexpected_endings": [u for r in self.records for u in r["unexpected"]],
            "problems": [p for r in self.records for p in r["problems"]],
            "pages_not_back": pages_short, "leaks": leaking, "trends": trends,
            "faults": dict(Counter(f.rsplit(" ", 1)[0] if f.startswith("killed") else f
                                   for r in self.records for f in r["faults"])),
            "latency_s": _drift(series["latency_s"]),
        }
        out["passed"] = not (out["lost"] or out["version_problems"] or out["unexpected_endings"] or out["problems"]
                             or pages_short or leaking)
        out["warmup_not_over"] = settling
        out["verdict"] = ("failed" if not out["passed"] else
                          f"inconclusive: {out['iterations']} iterations, warm-up not over" if settling else "passed")
        return out

    def finish(self) -> dict[str, Any]:
        print(file=sys.stderr)
        self.lines.close()
        summary = self.summary()
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
        self._plots()
        return summary

    def _plots(self) -> None:
        """A PNG per series (when matplotlib is installed: `pip install matplotlib`)."""
        try:
            import matplotlib
        except ImportError:
            print("[soak] matplotlib is not installed: no PNGs written", file=sys.stderr)
            return

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        for metric, lines in self.series().items():
            if not lines:
                continue
            fig, ax = plt.subplots(figsize=(8, 4))
            for name, values in sorted(lines.items()):
                ax.plot(range(len(values)), values, label=name, linewidth=1)
            ax.set_xlabel("iteration")
            ax.set_ylabel(metric)
            ax.legend(fontsize="x-small")
            fig.tight_layout()
            fig.savefig(self.out / f"{metric}.png", dpi=90)
            plt.close(fig)
