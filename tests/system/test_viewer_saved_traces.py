"""Traces saved by `python -m engine.trace --json` open in the viewer (headless Chromium, the page served
by a FastAPI app of its own) grouped as their family decodes: a DiffusionGemma trace by canvas,
labelled as the trace names its canvases, whatever the prompt's length; a Nemotron-Labs-Diffusion
`diffusion` trace by blocks counted from the prompt end, and a `linear_spec` one by verify, each
holding the tokens it accepted."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

pytest.importorskip("selenium")
pytest.importorskip("transformers.models.diffusion_gemma")

from engine.trace import main  # noqa: E402
from tests.support import nemotron  # noqa: E402
from tests.support.viewer import CHROMEDRIVER, CHROMIUM, browser, cells, expected_cells, open_files  # noqa: E402, F401

ckpt = nemotron.ckpt  # the tiny Nemotron-Labs-Diffusion checkpoint (blocks of 8)
GROUPS = ("return [...document.querySelectorAll(\"section.run[data-run='a'] .block\")].map(b => "
          "[b.querySelector('.block-label').textContent, b.querySelectorAll('[data-position]').length])")

pytestmark = [pytest.mark.system, pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None, reason="needs Debian's chromium and chromium-driver on PATH")]


@pytest.fixture(scope="module")
def viewer_url():
    import uvicorn
    from fastapi import FastAPI

    from deployments.viewer import add_viewer

    app = FastAPI()
    add_viewer(app)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=30)


def test_a_saved_renoising_trace_is_drawn_by_canvas(browser, viewer_url, gemma_ckpt, tmp_path, capsys):  # noqa: F811
    path = tmp_path / "dg.json"
    assert main([str(gemma_ckpt), "23+58=", "--max-new-tokens", "24", "--seed", "2", "--max-denoising-steps", "4",
                 "--no-colour", "--json", str(path)]) == 0
    capsys.readouterr()
    body = json.loads(path.read_text())
    assert body["meta_info"]["prompt_tokens"] % body["trace"]["canvas_length"] != 0
    browser.get(f"{viewer_url}/viewer")
    assert open_files(browser, [path]) == "done"
    assert cells(browser, "a") == expected_cells(body)
    groups = browser.execute_script(GROUPS)
    want = [[f"canvas {c['canvas']}", c["positions"][1] - c["positions"][0]] for c in body["trace"]["canvases"]]
    assert groups == want == [["canvas 1", 16], ["canvas 2", 8]]


def saved_trace(path, argv: list[str], capsys) -> dict:
    assert main([*argv, "--no-colour", "--json", str(path)]) == 0
    capsys.readouterr()
    return json.loads(path.read_text())


def test_saved_nemotron_traces_are_drawn_by_block_and_by_verify(browser, viewer_url, ckpt, tmp_path, capsys):  # noqa: F811
    argv = [str(ckpt), "23+58=", "--max-new-tokens", "20"]
    blocks = saved_trace(tmp_path / "diffusion.json", argv, capsys)
    assert blocks["meta_info"]["prompt_tokens"] % 8 != 0  # so blocks at multiples of 8 would differ
    spec = saved_trace(tmp_path / "linear_spec.json", [*argv, "--mode", "linear_spec"], capsys)
    browser.get(f"{viewer_url}/viewer")
    assert open_files(browser, [tmp_path / "diffusion.json"]) == "done"
    assert cells(browser, "a") == expected_cells(blocks)
    assert browser.execute_script(GROUPS) == [["block 0", 8], ["block 1", 8], ["block 2", 4]]
    browser.get(f"{viewer_url}/viewer")
    assert open_files(browser, [tmp_path / "linear_spec.json"]) == "done"
    assert cells(browser, "a") == expected_cells(spec)
    accepted = spec["meta_info"]["acceptance_lengths"]
    want = [["prefill", 1]] + [[f"verify {k}", n] for k, n in enumerate(accepted, start=1)]
    got = browser.execute_script(GROUPS)
    assert got == want[: len(got)] and sum(n for _, n in got) == 20
