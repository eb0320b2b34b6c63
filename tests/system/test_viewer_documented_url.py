"""The viewer URL README.md and docs/viewer.md show, loaded as written (only the server's address is this
session's) in headless Chromium: run A draws what a greedy /generate answers, run B what a greedy
sequential /generate answers. The page's Temperature box shows 0, and a run started from the query
string sends what the form shows."""

from __future__ import annotations

import re
import urllib.parse

import pytest

from tests.support.paths import ROOT
from tests.support.viewer import (
    CHROMEDRIVER,
    CHROMIUM,
    browser,
    cells,
    console_errors,
    expected_cells,
    generate,
    open_page,
)

DOCUMENTED = "http://localhost:8000/viewer?"

pytestmark = pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                                reason="the viewer's browser test needs Debian's chromium and chromium-driver")
__all__ = ["browser"]  # the shared browser fixture (tests/support/viewer.py)


def documented_query() -> str:
    """The query string of the viewer URL in README.md, which docs/viewer.md shows too."""
    (readme,) = set(re.findall(re.escape(DOCUMENTED) + r'([^"\s]+)', (ROOT / "README.md").read_text()))
    assert DOCUMENTED + readme in (ROOT / "docs" / "viewer.md").read_text()
    return readme


def test_the_documented_url_draws_greedy_runs(browser, served_apps):  # noqa: F811 (the imported fixture)
    query = documented_query()
    app = served_apps["sdar"]
    assert open_page(browser, f"{app.url}/viewer?{query}") == "done"
    fields = dict(urllib.parse.parse_qsl(query))
    assert browser.find_element("id", "temperature").get_attribute("value") == "0"  # what the form shows
    a = {"prompt": fields["prompt"], "max_new_tokens": int(fields["max_new_tokens"]), "temperature": 0}
    b = {**a, "dllm_unmasking_strategy": fields["b.dllm_unmasking_strategy"]}
    assert cells(browser, "a") == expected_cells(generate(app.url, a))
    assert cells(browser, "b") == expected_cells(generate(app.url, b))
    assert console_errors(browser) == []
