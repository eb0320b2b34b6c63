"""The commands README.md, deployments/README.md and docs/*.md show, run or checked against the code:

- every `python -m X` names a module, and each documented invocation of one of ours parses (it is
  run with `--help` appended: argparse checks the arguments before it, then exits 0);
- every `blockserve serve` line builds valid application args; every Serve config named exists and
  its applications' args are valid; the `serve` / `ray` subcommands and flags used exist;
- every curl body is JSON the served shipped models answer with 200 (streams end with [DONE]), and
  where README shows the answer, its text, output_ids and step_map are what the server answers;
- README's Python snippets run and print what they say (the handle client against the cluster
  `blockserve serve` reports in its ready line), `engine.trace` prints README's step list, and every
  Python block in the docs compiles;
- `blockserve serve` on a cluster that cannot place the application prints why, without a traceback,
  names only flags that exist, and exits 1.

The servers are the shipped presets on this session's Ray cluster: configs/sdar-tiny.yaml through
`blockserve serve` (what `serve run serve_config.yaml` serves) and configs/qwen3-tiny.yaml."""

from __future__ import annotations

import json
import os
import re
import select
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from configs import EngineConfig
from deployments.app import AppArgs
from deployments.cli import app_args, build_parser
from tests.support.paths import BIN, ROOT
from tests.support.processes import interrupt, stop_process
from tests.support.ray_env import QUIET

DOCS = [ROOT / "README.md", ROOT / "deployments" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OURS = {"bench", "configs", "deployments", "engine", "testing", "tools", "training"}
SEPARATORS = {"&&", "||", ";", "|", "&"}
REDIRECTS = {">", ">>", "<"}
SHELL_WORDS = {"until", "while", "do", "then", "time", "nohup"}


@dataclass
class Block:
    doc: Path
    lang: str
    text: str
    start: int
    end: int


def blocks(doc: Path) -> list[Block]:
    text = doc.read_text()
    return [Block(doc, m[1], m[2], m.start(), m.end()) for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)]


def following(block: Block, all_blocks: list[Block]) -> Block | None:
    """The block right after `block` (nothing but whitespace between them): what a command prints."""
    text = block.doc.read_text()
    return next((b for b in all_blocks if b.start > block.start and not text[block.end:b.start].strip()), None)


def _logical_lines(script: str) -> list[str]:
    """Lines joined where a backslash continues them or a quoted string spans them."""
    out, pending = [], ""
    for line in script.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # "No closing quotation": the string goes on
            continue
        out.append(pending)
        pending = ""
    assert not pending, pending
    return out


def commands_with_env(script: str) -> list[tuple[dict[str, str], list[str]]]:
    """The simple commands of a shell snippet: (the VAR=value assignments before it, its argv)."""
    out = []
    for line in _logical_lines(script):
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split, lex.commenters = True, "#"
        argv: list[str] = []
        tokens = [*lex, ";"]
        for i, token in enumerate(tokens):
            if token in REDIRECTS or (i and tokens[i - 1] in REDIRECTS):  # `> FILE` is not an argument
                continue
            if token in SEPARATORS:
                env = {}
                while argv and (argv[0] in SHELL_WORDS or re.fullmatch(r"\w+=.*", argv[0])):
                    name, _, value = argv.pop(0).partition("=")
                    env[name] = value
                if argv:
                    out.append((env, argv))
                argv = []
            else:
                argv.append(token)
    return out


def commands(script: str) -> list[list[str]]:
    """The simple commands of a shell snippet, as argv lists without leading VAR=value assignments."""
    return [argv for _, argv in commands_with_env(script)]


def shell_blocks() -> list[Block]:
    return [b for doc in DOCS for b in blocks(doc) if b.lang == "bash"]


def all_commands() -> list[tuple[Block, list[str]]]:
    return [(b, argv) for b in shell_blocks() for argv in commands(b.text)]


def inline_commands() -> list[list[str]]:
    """The commands quoted in running text (`python -m bench --quick`)."""
    spans = [span for doc in DOCS for span in re.findall(r"`([^`\n]*python -m [^`\n]*)`", doc.read_text())]
    return [argv for span in spans for argv in commands(span)]


def program(argv: list[str]) -> str:
    return Path(argv[0]).name


def python_module(argv: list[str]) -> str | None:
    """X of `python -m X ...`."""
    if program(argv).startswith("python") and "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    return None


# ---- python -m, blockserve, serve, ray, pip ---------------------------------------------------------
def test_every_module_named_in_the_docs_exists():
    import importlib.util

    named = {m for doc in DOCS for m in re.findall(r"python -m ([\w.]+)", doc.read_text())}
    assert {"bench", "engine.trace", "pytest"} <= named
    assert [m for m in sorted(named) if importlib.util.find_spec(m) is None] == []


HELP_RUNNER = """
import contextlib, io, json, runpy, sys
results = []
for argv in json.loads(sys.argv[1]):
    sys.argv = [argv[0], *argv[1:], "--help"]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
        code = "returned without exiting"
    except SystemExit as e:
        code = e.code or 0
    results.append([argv, code, out.getvalue()[-2000:]])
print(json.dumps(results))
"""


def test_documented_module_invocations_parse():
    """`python -m X ARGS` as documented (in code blocks and in the text), for our modules that take
    arguments: ARGS --help exits 0."""
    invocations = []
    for argv in [*(argv for _, argv in all_commands()), *inline_commands()]:
        module = python_module(argv)
        if module and module.split(".")[0] in OURS:
            source = ROOT / (module.replace(".", "/") + ".py")
            sources = [source] if source.is_file() else sorted((ROOT / module.replace(".", "/")).glob("*.py"))
            if any("argparse" in s.read_text() for s in sources):  # a package: its CLI may be in any module
                invocations.append([module, *argv[argv.index("-m") + 2:]])
    assert len(invocations) >= 8, invocations
    proc = subprocess.run([sys.executable, "-c", HELP_RUNNER, json.dumps(invocations)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    failed = [(argv, code, out) for argv, code, out in json.loads(proc.stdout.splitlines()[-1]) if code != 0]
    assert failed == []


def _valid_app_args(args: dict) -> None:
    EngineConfig(**AppArgs.model_validate(args).engine)


def test_blockserve_command_lines_build_valid_app_args():
    lines = [argv for _, argv in all_commands() if program(argv) == "blockserve"]
    assert len(lines) >= 4
    for argv in lines:
        _valid_app_args(app_args(build_parser().parse_args(argv[1:])))


def test_serve_configs_named_exist_and_hold_valid_args():
    configs = {a for _, argv in all_commands() if program(argv) == "serve" for a in argv if a.endswith(".yaml")}
    assert {"serve_config.yaml", "configs/multinode.yaml"} <= configs
    for name in configs:
        data = yaml.safe_load((ROOT / name).read_text())
        for application in data["applications"]:
            if application["import_path"] == "deployments.llm:build_openai_app":  # a Ray Serve LLM config
                from deployments.llm.config import LLMServingArgs
                from deployments.llm.config import app_args as llm_app_args

                for config in LLMServingArgs.model_validate(application["args"]).llm_configs:
                    _valid_app_args(llm_app_args(config))
                continue
            assert application["import_path"] == "deployments.app:build_app"
            _valid_app_args(application["args"])


def test_serve_and_ray_subcommands_and_flags_exist():
    used: dict[tuple[str, str], set[str]] = {}
    for _, argv in all_commands():
        if program(argv) in ("serve", "ray") and len(argv) > 1:
            used.setdefault((program(argv), argv[1]), set()).update(a.split("=")[0] for a in argv if a.startswith("--"))
    assert ("serve", "run") in used and ("ray", "start") in used
    helps = {key: subprocess.Popen([str(BIN / key[0]), key[1], "--help"], stdout=subprocess.PIPE, text=True)
             for key in used}
    for key, proc in helps.items():
        text, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, key
        assert [f for f in sorted(used[key]) if f not in text] == [], key


def test_every_command_that_starts_or_joins_ray_says_its_auth_mode():
    """The cluster and everything that joins it must agree on RAY_AUTH_MODE: no command leaves it to
    whatever the shell has (disabled on one machine, token on a secured cluster)."""
    for b in shell_blocks():
        exported = re.search(r"^export RAY_AUTH_MODE=", b.text, re.M) is not None
        for env, argv in commands_with_env(b.text):
            if program(argv) in ("serve", "ray", "blockserve"):
                assert exported or env.get("RAY_AUTH_MODE") in ("disabled", "token"), (b.doc.name, argv)


def test_pip_extras_named_exist():
    from importlib.metadata import metadata

    extras = set(metadata("blockserve").get_all("Provides-Extra"))
    named = {e for _, argv in all_commands() if program(argv) == "pip" for a in argv
             for e in re.findall(r"^\.\[([\w,]+)\]$", a) for e in e.split(",")}
    assert "test" in named and named <= extras


def test_every_python_block_compiles():
    import ast

    for doc in DOCS:
        for b in blocks(doc):
            if b.lang == "python":  # top-level await: snippets for an asyncio REPL (`python -m asyncio`)
                compile(b.text, f"{b.doc.name}:{b.start}", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)


# ---- the servers -----------------------------------------------------------------------------------
DOCS_QWEN3 = "docs_qwen3"  # the AR preset's application, beside the CLI's


@pytest.fixture(scope="module")
def blockserve_cli(serve_cluster):
    """`blockserve serve --config configs/sdar-tiny.yaml` on this session's cluster: (url, ready line).
    While its process starts, the AR preset the scoring curls need (`docs_servers`) is deployed from this
    process, and at the module's end both applications are deleted at once: the two replicas start, and
    stop, side by side rather than one after the other."""
    from ray import serve

    from deployments.app import build_app

    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": serve_cluster.address}
    proc = subprocess.Popen([str(BIN / "blockserve"), "serve", "--config", "configs/sdar-tiny.yaml"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deployed = False
    try:
        args = yaml.safe_load((ROOT / "configs" / "qwen3-tiny.yaml").read_text())
        serve.run(build_app(args), name=DOCS_QWEN3, route_prefix=f"/{DOCS_QWEN3}", logging_config=QUIET)
        deployed = True
        readable, _, _ = select.select([proc.stdout], [], [], 300)
        ready = proc.stdout.readline() if readable else ""  # its one line, once the application answers
        assert ready.startswith("blockserve: application 'blockserve' ready at "), (ready, proc.poll())
        yield serve_cluster.url, ready
    finally:
        interrupt(proc)  # Ctrl-C: the CLI deletes its application while this process deletes the other
        try:
            if deployed:
                serve.delete(DOCS_QWEN3)
        finally:
            stop_process(proc, interrupted=True)


@pytest.fixture(scope="module")
def docs_servers(blockserve_cli, serve_cluster) -> dict[str, str]:
    """Base URLs: "sdar" (serve_config.yaml's application, from the CLI) and "qwen3" (the AR preset,
    deployed by `blockserve_cli` while the CLI starts)."""
    return {"sdar": blockserve_cli[0], "qwen3": f"{serve_cluster.url}/{DOCS_QWEN3}"}


def test_cli_ready_line_names_the_url_and_the_cluster(blockserve_cli, serve_cluster):
    url, ready = blockserve_cli
    assert f"ready at {url} on the Ray cluster at {serve_cluster.address} " in ready
    assert f"(RAY_ADDRESS={serve_cluster.address} for Serve handles)" in ready


@dataclass
class Curl:
    block: Block
    path: str
    body: dict | list | None


def curls() -> list[Curl]:
    """Every curl of the docs, but those whose body elides values (`[...]`: a shape, not a command)."""
    out = []
    for b, argv in all_commands():
        if program(argv) != "curl":
            continue
        (url,) = [a for a in argv if "localhost:8000" in a]
        data = argv[argv.index("-d") + 1] if "-d" in argv else None
        if data is None or "..." not in data:
            out.append(Curl(b, url.split("localhost:8000", 1)[1], None if data is None else json.loads(data)))
    return out


def _scoring(body: dict | list | None) -> bool:
    """A prompt-scoring body (max_new_tokens 0, no diffusion trajectory): for the AR model."""
    return isinstance(body, dict) and "dllm_trajectory" not in body and 0 in (
        body.get("max_tokens"), (body.get("sampling_params") or {}).get("max_new_tokens"))


def _ask(base: str, curl: Curl) -> tuple[int, str]:
    if curl.body is None:
        r = httpx.get(base + curl.path, timeout=120)
    else:
        r = httpx.post(base + curl.path, json=curl.body, timeout=120)
    return r.status_code, r.text


SHOWN_FIELDS = r'"(text|output_ids|step_map)":("(?:[^"\\]|\\.)*"|\[[^\]\[]*\])'


def _shown(text: str) -> list[tuple[str, str]]:
    """(field, value) for every text / output_ids / step_map in a JSON-ish answer, whitespace dropped."""
    return re.findall(SHOWN_FIELDS, re.sub(r"\s", "", text))


def _logprob_rows(text: str) -> list:
    """Every input_token_logprobs / output_token_logprobs list in a JSON-ish answer (`…` elsewhere)."""
    decoder = json.JSONDecoder()
    return [decoder.raw_decode(text, m.end())[0] for m in re.finditer(r'"(?:in|out)put_token_logprobs":\s*', text)]


def test_every_curl_is_answered_and_readme_answers_are_what_the_server_says(docs_servers):
    all_curls = curls()
    assert len(all_curls) >= 10
    readme_blocks = blocks(ROOT / "README.md")
    compared = 0
    for curl in all_curls:
        status, text = _ask(docs_servers["qwen3" if _scoring(curl.body) else "sdar"], curl)
        assert status == 200, (curl.block.doc.name, curl.path, curl.body, text)
        if isinstance(curl.body, dict) and curl.body.get("stream"):
            assert text.rstrip().endswith("data: [DONE]"), text[-500:]
        answer = following(curl.block, readme_blocks) if curl.block.doc.name == "README.md" else None
        if answer is not None and curl.block.doc.parent == ROOT:
            shown = _shown(answer.text)
            assert shown and shown == _shown(text)[:len(shown)], (curl.body, answer.text, text)
            rows = [r for r in _logprob_rows(answer.text) if r]  # shown rows: [logprob, token_id, text]
            got = [r for r in _logprob_rows(text) if r][:len(rows)]
            assert [[x for x in row if not isinstance(x, float)] for r in rows for row in r] == [
                [x for x in row if not isinstance(x, float)] for r in got for row in r], (rows, got)
            assert [x for r in rows for row in r for x in row if isinstance(x, float)] == pytest.approx(
                [x for r in got for row in r for x in row if isinstance(x, float)], abs=1e-4)
            compared += 1
    assert compared >= 5  # every README curl with its answer shown


# ---- README's Python --------------------------------------------------------------------------------
def _readme_python(marker: str) -> Block:
    (block,) = [b for b in blocks(ROOT / "README.md") if b.lang == "python" and marker in b.text]
    return block


def _expected_output(block: Block) -> list[str]:
    """The printed lines a snippet promises: the plain block right after it, else its print comments
    (` / ` separates lines, `…` ends a prefix)."""
    after = following(block, blocks(ROOT / "README.md"))
    if after is not None and after.lang == "":
        return after.text.strip().splitlines()
    lines = []
    for line in block.text.splitlines():
        if "print(" in line and "#" in line:
            lines += [part.strip() for part in line.split("#")[-1].split(" / ") if part.strip() != "…"]
    return lines


def _run_python(code: str, env: dict | None = None) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout.strip().splitlines()


def test_offline_snippet_prints_what_readme_shows():
    block = _readme_python("pipe.stream(")
    expected = _expected_output(block)
    assert len(expected) >= 5
    assert _run_python(block.text) == expected


def test_handle_snippet_against_the_cluster_the_ready_line_names(blockserve_cli, docs_servers):
    address = re.search(r"RAY_ADDRESS=(\S+) ", blockserve_cli[1])[1]
    block = _readme_python("get_app_handle")
    expected = _expected_output(block)
    assert len(expected) >= 3
    out = _run_python(block.text, {"RAY_ADDRESS": address, "RAY_AUTH_MODE": "disabled"})
    assert out[:len(expected)] == expected


def test_trace_command_prints_readme_step_list(tmp_path):
    readme_blocks = blocks(ROOT / "README.md")
    (block,) = [b for b in readme_blocks if "engine.trace" in b.text]
    (argv,) = commands(block.text)
    argv[argv.index("--png") + 1] = str(tmp_path / "trace.png")  # not the committed figure
    proc = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    shown = next(b for b in readme_blocks if b.start > block.start and b.lang == "")  # after a sentence of prose
    expected = [line.rstrip() for line in shown.text.strip().splitlines()]
    printed = [line.rstrip() for line in re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout).splitlines()]
    assert any(printed[i:i + len(expected)] == expected for i in range(len(printed))), (printed, expected)
    assert (tmp_path / "trace.png").stat().st_size > 0


# ---- placement refused by the CLI -----------------------------------------------------------------
@pytest.mark.system  # `blockserve serve` in a process of its own
def test_unplaceable_tp_group_exits_1_with_the_reason_and_flags_that_exist(serve_cluster):
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_ADDRESS": serve_cluster.address}
    proc = subprocess.run([str(BIN / "blockserve"), "serve", "models/sdar-tiny", "--tp", "2", "--num-cpus", "64"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    message = proc.stderr.strip().splitlines()[-1]
    assert message.startswith("blockserve serve: cannot place EngineServer replica 1"), message
    flags = set(re.findall(r"--[a-z][a-z-]+", message))
    assert {"--num-cpus", "--placement-strategy"} <= flags
    parser = build_parser()
    for flag in flags:
        parser.parse_args(["serve", "x", flag, "PACK" if flag == "--placement-strategy" else "1"])
