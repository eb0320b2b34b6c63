"""What a new user reads first: `blockserve serve --help`, the refusal of a field from the other body
shape, the extras the docs tell them to install, and docs/migrate.md's JetEngine snippet (it prints
what it made; the page says the embedded tiny model answers noise)."""

from __future__ import annotations

import ast
import re
import typing

import pytest
import tomllib

from configs import EngineConfig
from deployments.cli import build_parser
from deployments.errors import ApiError
from deployments.sglang.serving import generate_plan
from tests.support.paths import ROOT


def _serve_help() -> str:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["serve"].format_help()


def test_serve_help_explains_port_and_lists_strategies():
    text = " ".join(_serve_help().split())
    assert "--port PORT HTTP port (default: 8000)" in text
    for strategy in typing.get_args(EngineConfig.model_fields["dllm_unmasking_strategy"].annotation):
        assert strategy in text


def test_flat_generate_body_refuses_max_new_tokens_naming_max_tokens():
    with pytest.raises(ApiError) as e:
        generate_plan({"prompt": "23+58=", "max_new_tokens": 8})
    assert e.value.param == "max_new_tokens" and "use max_tokens" in e.value.message


def test_documented_client_packages_come_with_a_named_extra():
    """The OpenAI client and selenium snippets, and the HTTP tools of bench/, install with an extra the
    docs name."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {e: {r.split(">")[0].split("=")[0].split("[")[0] for r in reqs} for e, reqs in extras.items()}
    assert {"openai", "selenium"} <= names["clients"] and "httpx" in names["bench"]
    docs = "\n".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    assert "'.[clients]'" in docs and "'.[bench]'" in docs


def _migrate_block(start: str) -> str:
    text = (ROOT / "docs" / "migrate.md").read_text()
    return next(b for b in re.findall(r"^```python\n(.*?)^```", text, re.M | re.S) if b.startswith(start))


def test_jetengine_snippet_prints_its_triples_and_the_page_says_tiny_models_answer_noise(capsys):
    exec(compile(_migrate_block("from engine.jetengine import LLM, SamplingParams\n\nllm"), "<migrate.md>", "exec"), {})
    printed = capsys.readouterr().out
    triples = ast.literal_eval(printed.strip())
    assert len(triples) == 1 and triples[0][0] == 0 and triples[0][1] and triples[0][2]
    text = " ".join((ROOT / "docs" / "migrate.md").read_text().split())
    assert text.count("noise on `models/sdar-tiny`") + text.count("this prints noise, and that is expected") == 2
