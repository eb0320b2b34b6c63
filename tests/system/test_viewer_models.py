"""The denoising viewer beyond one block-diffusion model, in headless Chromium (tests/support/viewer.py's browser):

- on the several-model application configs/ray-serve-llm.yaml serves (built as `serve run` builds it),
  `/viewer` is a page that picks the first model, says so and lets the user pick another; the knob row
  follows the picked model's paradigm; `/viewer?model=X` loads styled, and its files and its requests
  (/server_info, /generate) all carry the model; an unknown model is a 404 naming the served ones;
- on a DiffusionGemma model (renoising), the groups of cells are labelled as canvases (canvas 1, 2, 3),
  not by the step offsets that tell them apart, and the knob row offers the renoising knobs, not block
  diffusion's; the page gets each paradigm's knobs from configs.knobs, through the viewer's Python side.
"""

from __future__ import annotations

import importlib
import json
import re
import urllib.parse

import httpx
import pytest
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

from configs.knobs import KNOBS, PARADIGMS, rules_of
from tests.support.ray_env import QUIET
from tests.support.viewer import (
    CHROMEDRIVER,
    CHROMIUM,
    PROMPT,
    WAIT_S,
    browser,
    cells,
    console_errors,
    expected_cells,
    open_page,
    wait_state,
)

MODELS = ["sdar-tiny", "qwen3-tiny"]  # the shipped YAML's, in its order
CANVAS = 16
DG_PROMPT = list(range(30, 39))  # 9 tokens: three canvases of 16, 16 and 8 for 40 new tokens
DG_NEW = 40
DG_ENGINE = {"max_model_len": 512, "kv_block_size": 4, "num_kv_blocks": 512, "max_batch_size": 16,
             "dllm_max_denoising_steps": 12, "dllm_stability_threshold": 0, "dllm_stop_entropy": 0.8}

needs_browser = pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                                   reason="the viewer's browser test needs Debian's chromium and chromium-driver")
__all__ = ["browser"]  # the shared browser fixture (tests/support/viewer.py)


def has_diffusion_gemma() -> bool:
    return importlib.util.find_spec("transformers.models.diffusion_gemma") is not None


@pytest.fixture(scope="module")
def apps(serve_pool, tmp_path_factory):
    """`models`: the shipped YAML's application (sdar-tiny and qwen3-tiny behind one front ingress), built
    from its import_path and args as `serve run` builds it (the session's pool holds it); `dg`: a tiny
    DiffusionGemma (when transformers has the family), deployed beside it."""
    urls = {"models": serve_pool["llm_yaml"].url}
    if not has_diffusion_gemma():
        yield urls
        return
    from ray import serve

    from bench.diffusion_gemma import converging_checkpoint
    from deployments.app import build_app

    ckpt = converging_checkpoint(tmp_path_factory.mktemp("viewer_dg") / "tiny", CANVAS)
    serve.run(build_app({"model": str(ckpt), "engine": DG_ENGINE}), name="viewer_dg", route_prefix="/viewer_dg",
              logging_config=QUIET)
    yield urls | {"dg": f"{serve_pool.cluster.url}/viewer_dg"}
    serve.delete("viewer_dg", _blocking=False)


# ---- helpers -------------------------------------------------------------------------------------
def wait_for(driver, script: str, *args):
    """The script's value once it is truthy."""
    return WebDriverWait(driver, WAIT_S).until(lambda d: d.execute_script(script, *args))


def server_names(driver, model: str) -> None:
    """Wait until the page's header describes `model` (the page has its /server_info answer)."""
    wait_for(driver, "return document.getElementById('server').textContent.includes(arguments[0])", model)


def knob_row(driver) -> list[str]:
    """The ids of the decoding knobs the page offers (its paradigm's row)."""
    return driver.execute_script("return [...document.querySelectorAll('#dllm-knobs [id^=dllm_]')].map(e => e.id)")


def requests_of(driver) -> list[str]:
    """Every URL the page fetched (its files, its API calls), in order."""
    return driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")


def failed_requests(driver) -> list[tuple[str, int]]:
    return [tuple(e) for e in driver.execute_script(
        "return performance.getEntriesByType('resource').filter(e => e.responseStatus >= 400)"
        ".map(e => [e.name, e.responseStatus])")]


def styled(driver) -> bool:
    """viewer.css applied: the page's background and the knobs' flex rows."""
    return driver.execute_script(
        "return getComputedStyle(document.body).backgroundColor === 'rgb(250, 250, 250)' && "
        "getComputedStyle(document.getElementById('knobs')).display === 'flex'")


def generate(url: str, model: str | None, fields: dict, **top: object) -> dict:
    """The unary /generate body of the request the page sends for these knobs (`seed` as the page sends it;
    `top`: more top-level fields of the body)."""
    params = {("sampling_seed" if k == "seed" else k): v for k, v in fields.items() if k not in ("prompt", "input_ids")}
    body = {"return_step_trace": True, "sampling_params": params, **top}
    body |= {"input_ids": fields["input_ids"]} if "input_ids" in fields else {"text": fields["prompt"]}
    r = httpx.post(f"{url}/generate", params={"model": model} if model else None, json=body, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    return r.json()


def offered(paradigm: str) -> list[str]:
    """What the knob row should offer a model of `paradigm`: every per-request knob the paradigm reads, but
    the block length (the model's own: a request may only repeat it)."""
    return [k.name for k in KNOBS.values() if paradigm in k.used_by and k.per_request and k.name != "dllm_block_length"]


# ---- tests ---------------------------------------------------------------------------------------
def test_the_knob_table_the_page_gets_is_configs_knobs():
    from deployments.viewer import knob_table

    table = knob_table()
    assert set(table) == set(PARADIGMS)
    for paradigm, knobs in table.items():
        assert [k["name"] for k in knobs] == offered(paradigm), paradigm
        for knob in knobs:
            assert knob["doc"] and knob["label"], knob
            if knob["name"] == "dllm_unmasking_strategy":
                assert knob["kind"] == "choice" and knob["choices"] == list(rules_of(paradigm))
    assert table["autoregressive"] == []
    assert {k["name"]: k["kind"] for k in table["renoising"]}["dllm_max_denoising_steps"] == "int"
    threshold = next(k for k in table["block"] if k["name"] == "dllm_confidence_threshold")
    assert (threshold["kind"], threshold["min"], threshold["max"]) == ("float", 0.0, 1.0)


@needs_browser
def test_viewer_without_a_model_picks_the_first_says_so_and_offers_the_others(browser, apps):
    url = apps["models"]
    page = httpx.get(f"{url}/viewer", timeout=60)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html"), page.text
    browser.get(f"{url}/viewer")
    server_names(browser, MODELS[0])
    picker = Select(browser.find_element(By.ID, "model"))
    assert picker.first_selected_option.get_attribute("value") == MODELS[0]
    assert [o.get_attribute("value") for o in picker.options] == MODELS
    assert browser.find_element(By.ID, "model").is_displayed()
    note = browser.find_element(By.ID, "model-note")
    assert note.is_displayed() and MODELS[0] in note.text and "2 models" in note.text, note.text
    assert "model=sdar-tiny" in browser.execute_script("return location.search")  # a reload keeps it
    assert styled(browser)
    assert knob_row(browser) == offered("block")  # SDAR: block diffusion

    api = [u for u in requests_of(browser) if re.search(r"/(generate|server_info)\b", u)]
    assert api and all("model=sdar-tiny" in u for u in api), api
    before = len(requests_of(browser))
    picker.select_by_value("qwen3-tiny")  # an autoregressive model: no decoding knobs
    server_names(browser, "qwen3-tiny")
    wait_for(browser, "return document.getElementById('dllm-knobs').dataset.paradigm === 'autoregressive'")
    assert knob_row(browser) == []
    assert "model=qwen3-tiny" in browser.execute_script("return location.search")
    browser.find_element(By.ID, "prompt").send_keys("23+58=")
    browser.find_element(By.ID, "max_new_tokens").clear()
    browser.find_element(By.ID, "max_new_tokens").send_keys("6")
    browser.find_element(By.ID, "run").click()
    assert wait_state(browser) == "done", browser.find_element(By.ID, "error").text
    body = generate(url, "qwen3-tiny", {"prompt": "23+58=", "max_new_tokens": 6, "temperature": 0})
    assert cells(browser, "a") == expected_cells(body)
    api = [u for u in requests_of(browser)[before:] if re.search(r"/(generate|server_info)\b", u)]
    assert any("/generate?" in u for u in api) and all("model=qwen3-tiny" in u for u in api), api
    assert failed_requests(browser) == [] and console_errors(browser) == []


@needs_browser
def test_viewer_of_a_named_model_loads_styled_and_every_request_carries_the_model(browser, apps):
    url = apps["models"]
    a = {"prompt": PROMPT, "max_new_tokens": 16, "temperature": 0}
    query = {"model": "sdar-tiny", **a, "b.dllm_unmasking_strategy": "sequential"}
    assert open_page(browser, f"{url}/viewer?{urllib.parse.urlencode(query)}") == "done", \
        browser.find_element(By.ID, "error").text
    assert styled(browser)
    loaded = requests_of(browser)
    assert any(u.endswith(".css?model=sdar-tiny") for u in loaded), loaded
    assert any("/generate?" in u for u in loaded) and any("/server_info?" in u for u in loaded), loaded
    assert all(urllib.parse.parse_qs(urllib.parse.urlsplit(u).query).get("model") == ["sdar-tiny"]
               for u in loaded), loaded
    assert failed_requests(browser) == [] and console_errors(browser) == []
    assert not browser.find_element(By.ID, "model-note").is_displayed()  # named, not defaulted
    assert cells(browser, "a") == expected_cells(generate(url, "sdar-tiny", a))
    b = generate(url, "sdar-tiny", {**a, "dllm_unmasking_strategy": "sequential"})
    assert cells(browser, "b") == expected_cells(b)

    missing = httpx.get(f"{url}/viewer", params={"model": "no-such-model"}, timeout=60)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    assert all(m in missing.json()["error"]["message"] for m in ["no-such-model", *MODELS])


@needs_browser
def test_diffusion_gemma_groups_are_canvases_and_its_knob_row_is_renoisings(browser, apps, tmp_path):
    if "dg" not in apps:
        pytest.skip("transformers has no DiffusionGemma")
    fields = {"input_ids": DG_PROMPT, "max_new_tokens": DG_NEW, "seed": 0, "dllm_max_denoising_steps": 10}
    query = {k: ",".join(map(str, v)) if isinstance(v, list) else v for k, v in fields.items()}
    assert open_page(browser, f"{apps['dg']}/viewer?{urllib.parse.urlencode(query)}") == "done", \
        browser.find_element(By.ID, "error").text
    assert knob_row(browser) == offered("renoising")
    assert browser.find_element(By.ID, "dllm_max_denoising_steps").get_attribute("value") == "10"
    body = generate(apps["dg"], None, {**fields, "temperature": 0})
    assert cells(browser, "a") == expected_cells(body)

    groups = browser.execute_script(
        "return [...document.querySelectorAll(\"section.run[data-run='a'] .block\")].map(b => "
        "[b.querySelector('.block-label').textContent, b.querySelectorAll('[data-position]').length])")
    assert groups == [["canvas 1", CANVAS], ["canvas 2", CANVAS], ["canvas 3", DG_NEW - 2 * CANVAS]]
    head = browser.execute_script("return document.querySelector(\"section.run[data-run='a'] table th\").textContent")
    assert head == "canvas"
    first = browser.find_element(By.CSS_SELECTOR, "section.run[data-run='a'] [data-position='0']")
    assert "(canvas 1: positions 0–15)" in first.get_attribute("title")
    assert console_errors(browser) == []

    # the body saved with its block_step_map: a file whose `trace.paradigm` is renoising is drawn as canvases
    saved = generate(apps["dg"], None, {**fields, "temperature": 0}, return_block_step_map=True)
    path = tmp_path / "canvases.json"
    path.write_text(json.dumps({**saved, "trace": {"paradigm": "renoising"}}))
    browser.execute_script("document.body.dataset.state = 'idle'")
    browser.find_element(By.ID, "open-file").send_keys(str(path))
    assert wait_state(browser) == "done", browser.find_element(By.ID, "error").text
    labels = browser.execute_script(
        "return [...document.querySelectorAll(\"section.run[data-run='a'] .block-label\")].map(l => l.textContent)")
    assert labels == ["canvas 1", "canvas 2", "canvas 3"]
