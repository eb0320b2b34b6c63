"""The denoising viewer in a real headless Chromium, driven by selenium through Debian's chromedriver: the
`browser` fixture (a module-scoped driver; a test module imports it, and reaching it puts a test in the
`system` tier), the prompt the viewer tests type, and the page helpers they share -- open a page and
wait for its runs, read a panel's token cells, the cells a /generate body should draw, the console's
errors, open saved files."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
PROMPT = "copy [h,e,l,l,o] ->"
WAIT_S = 180  # a generous bound for a page's requests on a loaded 2-core machine


@pytest.fixture(scope="module")
def browser():
    options = Options()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1500,700",
                "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-default-apps", "--disable-extensions"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(WAIT_S)
    yield driver
    driver.quit()


def wait_state(driver) -> str:
    WebDriverWait(driver, WAIT_S).until(lambda d: d.execute_script("return document.body.dataset.state")
                                        in ("done", "error"))
    return driver.execute_script("return document.body.dataset.state")


def open_page(driver, url: str) -> str:
    driver.get(url)
    return wait_state(driver)


def cells(driver, run: str) -> list[tuple[int, int, int]]:
    """(data-position, data-token-id, data-step) of every token cell of panel `run`, in page order."""
    return [tuple(c) for c in driver.execute_script(
        "return [...document.querySelectorAll(`section.run[data-run='${arguments[0]}'] [data-position]`)]"
        ".map(c => [Number(c.dataset.position), Number(c.dataset.tokenId), Number(c.dataset.step)])", run)]


def expected_cells(body: dict) -> list[tuple[int, int, int]]:
    steps = body["meta_info"]["step_map"] or range(1, len(body["output_ids"]) + 1)  # AR: a step per token
    return [(p, t, s) for p, (t, s) in enumerate(zip(body["output_ids"], steps))]


def console_errors(driver) -> list[dict]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def generate(url: str, fields: dict, key: str | None = None) -> dict:
    """The unary /generate body of the request the page sends for these knobs."""
    body = {"text": fields["prompt"], "return_step_trace": True,
            "sampling_params": {k: v for k, v in fields.items() if k != "prompt"}}
    headers = {"Authorization": f"Bearer {key}"} if key else None
    r = httpx.post(f"{url}/generate", json=body, headers=headers, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    return r.json()


def open_files(driver, paths: list[Path]) -> str:
    driver.execute_script("document.body.dataset.state = 'idle'")
    driver.find_element(By.ID, "open-file").send_keys("\n".join(str(p) for p in paths))
    return wait_state(driver)
