"""Server processes a test starts (`blockserve serve`, `serve run`): waiting until one answers, and
stopping it as a user would (`stop_later`, a fixture loaded by tests/conftest.py: while the module's next
tests run)."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Callable

import pytest


def stop_process(proc: subprocess.Popen, timeout: float = 60, *, interrupted: bool = False) -> None:
    """Ctrl-C for a server process a test started (its Ray cleanup runs, `serve run` deletes its
    application), then kill if it lingers past `timeout` seconds. Its output pipes are read meanwhile:
    a process whose shutdown messages fill a pipe nobody reads blocks on the write and never exits.
    `interrupted`: the test sent the Ctrl-C already (`interrupt`, to do something else while the process
    stops); only the wait is left (a second Ctrl-C would interrupt its cleanup)."""
    if proc.poll() is None:
        if not interrupted:
            proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def interrupt(proc: subprocess.Popen) -> None:
    """Ctrl-C for a server process, without waiting for it to stop: `stop_process(proc, interrupted=True)`
    waits (and kills it if it lingers)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)


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


@pytest.fixture(scope="module")
def stop_later():
    """`stop_later(stop)`: run `stop` (a test's `stop_process` calls, in the order the test needs) in a thread
    from now on, and wait for it when the module ends. A server's Ctrl-C cleanup (deleting its application,
    stopping the Ray cluster it started) takes seconds that nothing checks; meanwhile the module's next
    tests run. An error in `stop` fails the module's last teardown."""
    stopping: list[tuple[threading.Thread, list[BaseException]]] = []

    def start(stop: Callable[[], None]) -> None:
        errors: list[BaseException] = []

        def run() -> None:
            try:
                stop()
            except BaseException as e:  # re-raised when the module ends
                errors.append(e)

        thread = threading.Thread(target=run, name="stop_later")
        thread.start()
        stopping.append((thread, errors))

    yield start
    for thread, _ in stopping:
        thread.join()  # bounded: stop_process kills what lingers
    for _, errors in stopping:
        if errors:
            raise errors[0]
