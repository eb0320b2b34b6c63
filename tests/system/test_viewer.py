"""The denoising viewer (GET /viewer) in a real headless Chromium, driven by selenium through Debian's
chromedriver, against applications on the session's Ray cluster:

- a live run of two strategies side by side draws, per panel, exactly the `output_ids` and
  `meta_info.step_map` that the same request sent to /generate answers; that body, saved with its
  step trace, opens in the page with the same cells; the page loads nothing from another origin and
  logs no console error;
- an autoregressive model behind an API key, streaming deltas: the page asks for the key; one cell
  per token, one step per token;
- a bad knob ends in `data-state="error"` with a visible message naming the field;
- traces saved by `python -m engine.trace --json` (two strategies on the shipped SDAR model) open
  side by side with their cells, replay with the keys, make the screenshot README shows
  (`BLOCKSERVE_VIEWER_SCREENSHOT=docs/viewer.png` writes it there), and open by URL (`?trace=`);
- a position written twice is drawn as an edit whose step is its last write.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
import threading
import urllib.parse
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys

from tests.support import viewer
from tests.support.paths import ROOT
from tests.support.serve_pool import QWEN3_KEY as AR_KEY
from tests.support.viewer import (
    CHROMEDRIVER,
    CHROMIUM,
    PROMPT,
    cells,
    console_errors,
    expected_cells,
    generate,
    open_files,
    open_page,
    wait_state,
)

STATIC = ROOT / "deployments" / "viewer" / "static"
browser = viewer.browser  # the shared fixture: a module-scoped headless Chromium
pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="the viewer's browser test needs Debian's chromium and chromium-driver on PATH "
           "(apt-get install chromium chromium-driver; .ci/run installs them)")


@pytest.fixture(scope="module")
def ar_key_app(serve_pool):
    """The pool's `qwen3_keyed`: tiny Qwen3 (AR) behind an API key, streaming deltas
    (incremental_streaming_output)."""
    return serve_pool["qwen3_keyed"]


class _CorsFiles(SimpleHTTPRequestHandler):
    """A directory's files, fetchable by a page of another origin."""

    def end_headers(self) -> None:
        self.send_header("Access-Control-Allow-Origin", "*")
        super().end_headers()

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def files_url(tmp_path):
    """tmp_path served on a loopback port (another origin than the page's)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_CorsFiles, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


# ---- helpers -------------------------------------------------------------------------------------


# ---- tests -----------------------------------------------------------------------------------------
def test_live_runs_of_two_strategies_draw_what_generate_answers(browser, served_apps, tmp_path):
    app = served_apps["sdar"]
    a = {"prompt": PROMPT, "max_new_tokens": 24, "temperature": 0, "dllm_unmasking_strategy": "low_confidence_dynamic",
         "dllm_confidence_threshold": 0.5}
    b = {**a, "dllm_unmasking_strategy": "sequential"}
    query = {**a, "b.dllm_unmasking_strategy": "sequential"}
    assert open_page(browser, f"{app.url}/viewer?{urllib.parse.urlencode(query)}") == "done", \
        browser.find_element(By.ID, "error").text
    answers = {"a": generate(app.url, a), "b": generate(app.url, b)}
    for run, body in answers.items():
        assert cells(browser, run) == expected_cells(body), run
    assert answers["a"]["meta_info"]["step_map"] != answers["b"]["meta_info"]["step_map"]  # two decodings shown
    assert console_errors(browser) == []
    origin = app.url.rsplit("/", 1)[0]
    loaded = browser.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert loaded and all(u.startswith(origin + "/") for u in loaded), loaded

    # the unary body with its step trace, saved, opens with the same cells
    saved = tmp_path / "generate.json"
    saved.write_text(json.dumps(answers["b"]))
    assert open_files(browser, [saved]) == "done"
    assert cells(browser, "a") == expected_cells(answers["b"])
    assert console_errors(browser) == []


def test_the_page_and_its_files_name_no_other_origin(served_apps):
    url = served_apps["sdar"].url
    page = httpx.get(f"{url}/viewer", timeout=60)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<base href="/sdar/">' in page.text  # the page's requests stay under the route prefix
    sources = [page.text] + [httpx.get(f"{url}/viewer/static/{p.name}", timeout=60).text
                             for p in sorted(STATIC.iterdir()) if p.suffix in (".js", ".css")]
    urls = {u for text in sources for u in re.findall(r"(?:https?:)?//[\w.-]+\.\w+[^\s\"'`)]*", text)}
    assert urls <= {"http://www.w3.org/2000/svg"}, urls  # the SVG namespace is a name, never fetched
    missing = httpx.get(f"{url}/viewer/static/viewer.py", timeout=60)
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found"


def test_ar_model_behind_an_api_key_draws_a_cell_and_a_step_per_token(browser, ar_key_app):
    fields = {"prompt": "23+58=", "max_new_tokens": 12, "temperature": 0}
    assert httpx.get(f"{ar_key_app.url}/viewer", timeout=60).status_code == 200  # the page needs no key
    assert open_page(browser, f"{ar_key_app.url}/viewer?{urllib.parse.urlencode(fields)}") == "error"
    assert "API key" in browser.find_element(By.ID, "error").text
    browser.get_log("browser")  # the 401 the page just got is logged by Chromium itself
    browser.find_element(By.ID, "api-key").send_keys(AR_KEY)
    browser.find_element(By.ID, "run").click()
    assert wait_state(browser) == "done", browser.find_element(By.ID, "error").text
    body = generate(ar_key_app.url, fields, AR_KEY)
    assert body["meta_info"]["step_map"] is None and len(body["output_ids"]) > 1
    assert cells(browser, "a") == expected_cells(body)
    assert console_errors(browser) == []


def test_a_bad_knob_ends_in_the_error_state_naming_the_field(browser, served_apps):
    query = {"prompt": PROMPT, "max_new_tokens": 8, "dllm_unmasking_strategy": "fastest_first"}
    assert open_page(browser, f"{served_apps['sdar'].url}/viewer?{urllib.parse.urlencode(query)}") == "error"
    error = browser.find_element(By.ID, "error")
    assert error.is_displayed() and "dllm_unmasking_strategy" in error.text, error.text
    browser.get_log("browser")  # the 400 the page got is logged by Chromium itself


def test_traces_saved_by_the_cli_open_side_by_side_by_url_and_replay(browser, served_apps, tmp_path, files_url):
    files = []
    for strategy in ("low_confidence_dynamic", "sequential"):
        path = tmp_path / f"{strategy}.json"
        proc = subprocess.run([sys.executable, "-m", "engine.trace", "models/sdar-tiny", PROMPT, "--max-new-tokens",
                               "24", "--strategy", strategy, "--json", str(path)],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        assert "\x1b[" not in proc.stdout  # no colour codes into a pipe
        files.append(path)
    browser.get(f"{served_apps['sdar'].url}/viewer")
    assert open_files(browser, files) == "done"
    for run, path in zip("ab", files):
        assert cells(browser, run) == expected_cells(json.loads(path.read_text())), run
    browser.execute_script("document.activeElement.blur()")  # the keys go to the page, not a form field
    ActionChains(browser).send_keys(Keys.HOME).perform()
    masked = "return document.querySelectorAll(\"section.run[data-run='a'] .cell.masked\").length"
    assert browser.execute_script(masked) == len(cells(browser, "a"))  # step 0: nothing decoded yet
    ActionChains(browser).send_keys(Keys.END).perform()
    assert browser.execute_script(masked) == 0
    assert console_errors(browser) == []
    shot = Path(os.environ.get("BLOCKSERVE_VIEWER_SCREENSHOT") or tmp_path / "viewer.png")
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 0

    url = f"{served_apps['sdar'].url}/viewer?{urllib.parse.urlencode({'trace': f'{files_url}/{files[1].name}'})}"
    assert open_page(browser, url) == "done", browser.find_element(By.ID, "error").text
    assert cells(browser, "a") == expected_cells(json.loads(files[1].read_text()))


def test_a_position_written_twice_is_an_edit_whose_step_is_its_last_write(browser, served_apps, tmp_path):
    body = {"text": "ab", "output_ids": [5, 7], "meta_info": {
        "finish_reason": {"type": "length"}, "prompt_tokens": 3, "step_map": [1, 2],
        "step_trace": [{"step": 1, "positions": [0, 1], "token_ids": [5, 6]},
                       {"step": 2, "positions": [1], "token_ids": [7]}]}}
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(body))
    browser.get(f"{served_apps['sdar'].url}/viewer")
    assert open_files(browser, [path]) == "done"
    assert cells(browser, "a") == [(0, 5, 1), (1, 7, 2)]
    edited = browser.find_element(By.CSS_SELECTOR, "section.run[data-run='a'] [data-position='1']")
    assert edited.get_attribute("data-edits") == "1" and "edited" in edited.get_attribute("class")
    assert "edited at step 2" in edited.get_attribute("title")


def test_insert_delete_steps_carry_each_token_to_its_new_position(browser, served_apps, tmp_path):
    """A step trace with `deleted` and `moves` (insert/delete editing): the deleted content is gone, the
    moved token keeps its history at its new position (not counted as an edit), and the tooltip says so."""
    body = {"text": "abc", "output_ids": [5, 7, 8], "meta_info": {
        "finish_reason": {"type": "length"}, "prompt_tokens": 3, "step_map": [1, 1, 3],
        "step_trace": [{"step": 1, "positions": [0, 1, 2], "token_ids": [5, 6, 7]},
                       {"step": 2, "positions": [], "token_ids": [], "moves": [[2, 1]], "deleted": [1]},
                       {"step": 3, "positions": [2], "token_ids": [8]}]}}
    path = tmp_path / "indel.json"
    path.write_text(json.dumps(body))
    browser.get(f"{served_apps['sdar'].url}/viewer")
    assert open_files(browser, [path]) == "done"
    assert cells(browser, "a") == [(0, 5, 1), (1, 7, 1), (2, 8, 3)]
    moved = browser.find_element(By.CSS_SELECTOR, "section.run[data-run='a'] [data-position='1']")
    assert moved.get_attribute("data-moved") == "true" and moved.get_attribute("data-edits") is None
    title = moved.get_attribute("title")
    assert "written at step 1" in title and "moved here at step 2" in title and "(id 6)" not in title
    assert not console_errors(browser)
