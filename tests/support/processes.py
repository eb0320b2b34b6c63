"""Server processes a test starts (`blockserve serve`, `serve run`): waiting until one answers, and
stopping it as a user would."""

from __future__ import annotations

import signal
import subprocess
import time


def stop_process(proc: subprocess.Popen, timeout: float = 60) -> None:
    """Ctrl-C for a server process a test started (its Ray cleanup runs, `serve run` deletes its
    application), then kill if it lingers past `timeout` seconds. Its output pipes are read meanwhile:
    a process whose shutdown messages fill a pipe nobody reads blocks on the write and never exits."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def wait_healthy(proc: subprocess.Popen, url: str, what: str, timeout: float = 300) -> None:
    """Poll `url`/health until it answers 200; fails with the process's stderr (it must have been
    started with stderr=PIPE) if it exits first, or naming `what` after `timeout` seconds."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.stderr.read()[-4000:]
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{what} never became healthy"
        time.sleep(1)
