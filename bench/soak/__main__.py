"""`python -m bench.soak`: the RL loop for N iterations or T minutes against a running application
(`--url`, `--api-key`) or one it starts (`--model`, `--tp`, `--replicas`; the tiny SDAR checkpoint
when no model is given). Writes soak.jsonl, a PNG per series and summary.json under `--out` (default: a new temporary
folder, named on stderr), prints the summary's JSON on stdout (nothing else goes there: the progress and Ray's own
lines go to stderr), and exits with status 1 on a leak, a lost request, a version mismatch or any other
broken promise. Ctrl-C ends the run after the iteration in progress, with its summary.

    python -m bench.soak --iterations 200                         # starts an app on the tiny SDAR
    python -m bench.soak --minutes 60 --kill-replica-every 50 --drop-client-every 10
    python -m bench.soak --url http://127.0.0.1:8000 --api-key KEY --minutes 30 --app blockserve
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import typing
from collections.abc import Iterator
from pathlib import Path

try:
    import httpx
except ModuleNotFoundError as missing:  # the bench extra is not installed: say so in one line, not a traceback
    sys.exit(f"python -m bench.soak needs {missing.name}, which the bench extra installs: "
             "pip install -e '.[bench]' (from the repository root)")

from bench.soak.loop import SoakLoop
from bench.soak.probe import app_processes, free_pages, sample_processes
from bench.soak.record import Recorder, iteration_record
from bench.soak.settings import SoakSettings
from bench.soak.updates import Updater

# the test cluster's engines for tiny checkpoints (EngineConfig fields), as bench.load uses
TINY_ENGINE = {"max_model_len": 512, "num_kv_blocks": 192, "kv_block_size": 4, "max_batch_size": 32,
               "dllm_block_length": 4}


def parse_args(argv: list[str] | None = None) -> SoakSettings:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, field in SoakSettings.model_fields.items():
        flag = "--" + name.replace("_", "-")
        if field.annotation is bool:
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=field.default,
                            help=field.description)
        else:
            kind = next(t for t in (*typing.get_args(field.annotation), field.annotation) if t is not type(None))
            ap.add_argument(flag, type=kind, default=field.default, help=field.description)
    args = vars(ap.parse_args(argv))
    try:
        return SoakSettings(**args)
    except ValueError as e:
        ap.error(str(e))


@contextlib.contextmanager
def started_app(s: SoakSettings) -> Iterator[str]:
    """A local Ray cluster serving `s.model` (the tiny SDAR when None) as application `s.app`, with
    the fault-drill hooks (deployments.drills) the leak test needs; yields its URL."""
    from bench.local_cluster import QUIET, local_serve

    with tempfile.TemporaryDirectory() as tmp, local_serve(num_cpus=16) as base:
        from ray import serve  # once the cluster runs: Ray is imported only after it was set up

        from deployments.drills import build_drill_app

        model, engine = s.model, {"tp": s.tp}
        if model is None:
            from testing.tiny_checkpoint import DLLM_TEST_LOGIT_SCALE, write_tiny_checkpoint

            model = str(write_tiny_checkpoint(Path(tmp) / "sdar", model_type="sdar",
                                              logit_scale=DLLM_TEST_LOGIT_SCALE))
            engine |= TINY_ENGINE
        args = {"model": model, "engine": engine, "num_replicas": s.replicas}
        if s.api_key:
            args["ingress"] = {"api_key": s.api_key}
        serve.run(build_drill_app(args), name=s.app, route_prefix=f"/{s.app}", logging_config=QUIET)
        yield f"{base}/{s.app}"


def _server_facts(client: httpx.Client, url: str) -> tuple[str, bool, int, int]:
    """(model path, is_dllm, engine ranks = replicas * tp, vocabulary size) of the application."""
    info = client.get(url + "/server_info").json()
    try:
        vocab = json.loads((Path(info["model_path"]) / "config.json").read_text())["vocab_size"]
    except (OSError, ValueError, KeyError):
        vocab = 1000  # the ids the soak sends stay below it
    return info["model_path"], info["internal_states"][0]["is_dllm"], info["dp_size"] * info["tp_size"], vocab


def _idle_pages(client: httpx.Client, url: str, timeout_s: float) -> dict[str, float]:
    """Free and total pages per engine replica once nothing runs and the prefix cache is flushed."""
    deadline = time.monotonic() + timeout_s
    while True:
        client.post(url + "/flush_cache")
        pages = free_pages(client, url)
        if all(pages[k] == pages.get(k.replace("free", "total")) for k in pages if k.startswith("free")):
            return pages
        if time.monotonic() > deadline:
            return pages
        time.sleep(0.2)


def out_dir(s: SoakSettings) -> Path:
    """`--out`, else a new temporary folder (never one in the working directory: a checkout stays clean)."""
    out = Path(s.out) if s.out else Path(tempfile.mkdtemp(prefix="blockserve-soak-"))
    print(f"[soak] writing soak.jsonl, summary.json and the PNGs to {out}", file=sys.stderr)
    return out


async def soak(s: SoakSettings, url: str, stop: asyncio.Event | None = None, root: int | None = None) -> dict:
    """Run the loop against `url` until the iterations or the minutes are done (or `stop` is set,
    after the iteration in progress); the summary. `root`: the process that started the application's
    Ray cluster, when this machine's (its processes are then told from other clusters' by ancestry)."""
    headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
    timeout = httpx.Timeout(s.request_timeout_s)
    with httpx.Client(headers=headers, timeout=timeout) as sync:
        model_path, is_dllm, ranks, vocab = _server_facts(sync, url)
        async with httpx.AsyncClient(headers=headers, timeout=timeout) as client:
            updater = Updater(client, url, s.update_from or model_path, s.app if _ray_connected() else None,
                              ranks, s.broadcast)
            loop = SoakLoop(s, client, url, updater, is_dllm, vocab, root)
            recorder = Recorder(out_dir(s), s.leak_limit_mb, s.iterations)
            end = time.monotonic() + s.minutes * 60 if s.minutes else None
            i = 0
            while ((s.iterations is None or i < s.iterations) and (end is None or time.monotonic() < end)
                   and not (stop and stop.is_set())):
                started = time.monotonic()
                it = await loop.run(i)
                if s.inject_leak_mb:
                    await asyncio.to_thread(_inject_leak, s.app, s.inject_leak_mb)
                pages = await asyncio.to_thread(_idle_pages, sync, url, 60.0)
                procs = sample_processes(app_processes(s.app, root))
                recorder.add(iteration_record(it, time.monotonic() - started, procs, pages))
                i += 1
            return recorder.finish()


async def _until_interrupted(s: SoakSettings, url: str, root: int | None) -> dict:
    """The soak, ended early by Ctrl-C with its summary written (after the iteration in progress)."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGINT, stop.set)
    return await soak(s, url, stop, root)


def _ray_connected() -> bool:
    return "ray" in sys.modules and sys.modules["ray"].is_initialized()


def _inject_leak(app: str, megabytes: float) -> None:
    from ray import serve

    serve.get_deployment_handle("EngineServer", app).broadcast("debug_leak", megabytes).results(timeout_s=60)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send everything written to stdout meanwhile to stderr, at the file descriptor too (what the processes
    started meanwhile inherit): Ray's driver prints `(raylet) ...` lines to stdout whatever `log_to_driver`
    says (its error messages: e.g. the tasks that Serve's shutdown leaves behind), so stdout would not be
    the summary's JSON alone."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no stdout to redirect
        saved = None
    if saved is not None:
        os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def main(argv: list[str] | None = None) -> int:
    s = parse_args(argv)
    with _stdout_to_stderr(), contextlib.ExitStack() as stack:
        if s.url is None:
            url = stack.enter_context(started_app(s))
        else:
            url = s.url.rstrip("/")
            if s.ray_address:
                import ray

                ray.init(address=s.ray_address, logging_level="error", log_to_driver=False)
                stack.callback(ray.shutdown)  # here, while what Ray prints still goes to stderr
        summary = asyncio.run(_until_interrupted(s, url, os.getpid() if s.url is None else None))
    print(json.dumps(summary, indent=1))  # stdout: the summary's JSON only
    print(f"[soak] {summary['verdict']}", file=sys.stderr)
    return 0 if summary["passed"] else 1  # an inconclusive memory verdict is no broken promise


if __name__ == "__main__":
    sys.exit(main())
