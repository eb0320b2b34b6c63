"""A DiffusionGemma trace saved by `python -m engine.trace --json` opens in the viewer (headless Chromium,
the page served by a FastAPI app of its own) with its positions grouped by canvas, labelled as the
trace names its canvases, whatever the prompt's length."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

pytest.importorskip("selenium")
pytest.importorskip("transformers.models.diffusion_gemma")

from engine.trace import main  # noqa: E402
from tests.support.viewer import CHROMEDRIVER, CHROMIUM, browser, cells, expected_cells, open_files  # noqa: E402, F401

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
    groups = browser.execute_script(
        "return [...document.querySelectorAll(\"section.run[data-run='a'] .block\")].map(b => "
        "[b.querySelector('.block-label').textContent, b.querySelectorAll('[data-position]').length])")
    want = [[f"canvas {c['canvas']}", c["positions"][1] - c["positions"][0]] for c in body["trace"]["canvases"]]
    assert groups == want == [["canvas 1", 16], ["canvas 2", 8]]
