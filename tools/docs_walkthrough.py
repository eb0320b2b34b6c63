"""Run the docs as a user would: a fresh clone, README's first command, then every fenced command of
README.md, deployments/README.md and docs/*.md, in document order, each compared with what its page
says it answers.

    .venv/bin/python -m tools.docs_walkthrough --out DIR          # the whole walk (about 30 minutes on 2 cores)
    .venv/bin/python -m tools.docs_walkthrough --out DIR --only docs/migrate.md --reuse
    .venv/bin/python -m tools.docs_walkthrough --out DIR --from README.md:171 --reuse

It clones the committed HEAD of this repository into DIR/clone (`--reuse`: keep a clone already there),
runs each block there with the clone's `.venv` as the docs write it, and writes DIR/walkthrough.md (one
row per block: ran or skipped and why, exit status, seconds, verdict) and DIR/logs/ (each block's
stdout and stderr). It exits 0 only when every block it ran answered as its page says.

The blocks are found in the docs; what to do with each is the table SPECS below (by doc and a
substring unique to the block): run it (shell or Python), start it as a server, skip it with a reason,
or treat it as text (a diagram, a config fragment, the output of the command above it). A block the
table does not name is run as a shell or Python block. The servers the docs start all listen on port
8000 (one at a time: a block that needs another server stops the current one with Ctrl-C, as the
docs say to, and starts the one it needs); every command runs with the environment of this process
less `RAY_ADDRESS`, `RAY_AUTH_MODE` and `PYTHONPATH`, so each starts or joins only the cluster its
page names. Not part of the pytest suite: it takes far longer than the suite's budget.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from deployments.single_machine import PortInUseError, check_port_free

ROOT = Path(__file__).resolve().parent.parent
DOC_GLOBS = ["README.md", "deployments/README.md", "docs/*.md"]
PORT = 8000
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n?", re.M | re.S)


# ---------------------------------------------------------------------------------------------- blocks

@dataclass
class Block:
    """One fenced block of a doc."""

    doc: str  # relative to the repository root
    line: int  # the line of the opening fence
    lang: str  # the fence's info string: sh, python, json, ... ('' when none)
    text: str  # between the fences
    start: int  # offset of the opening fence in the doc
    end: int  # offset after the closing fence

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def first_line(self) -> str:
        return next((ln.strip() for ln in self.text.splitlines() if ln.strip()), "")


def doc_paths(root: Path) -> list[str]:
    """The docs the walk reads, relative to `root`, in walk order (DOC_GLOBS, each glob sorted)."""
    paths = []
    for pattern in DOC_GLOBS:
        paths += sorted(str(p.relative_to(root)) for p in root.glob(pattern))
    return paths


def extract(root: Path, doc: str) -> list[Block]:
    """The fenced blocks of `doc`, in page order."""
    text = (root / doc).read_text()
    return [Block(doc, text.count("\n", 0, m.start()) + 1, m[1], m[2], m.start(), m.end())
            for m in FENCE.finditer(text)]


def shown_after(root: Path, block: Block, blocks: list[Block], prose: bool = False) -> Block | None:
    """The block right after `block` with only whitespace between them (or, with `prose`, a sentence
    saying what it prints): the output the page shows for it."""
    text = (root / block.doc).read_text()
    nxt = next((b for b in blocks if b.doc == block.doc and b.start >= block.end), None)
    return nxt if nxt is not None and (prose or not text[block.end:nxt.start].strip()) else None


# ------------------------------------------------------------------------------------------ the table

# The servers other blocks run against (all on port 8000), besides "readme": README's first command.
SERVERS = {
    "qwen3": "RAY_AUTH_MODE=disabled .venv/bin/blockserve serve --config configs/qwen3-tiny.yaml",
    "sdar": "RAY_AUTH_MODE=disabled .venv/bin/blockserve serve --config configs/sdar-tiny.yaml",
}
HEALTH_LOOP = "until curl -sf localhost:8000/health; do sleep 1; done; echo"
READY_LINE = re.compile(r"blockserve: application '\S+' ready at (\S+) on the Ray cluster at (\S+) ")


@dataclass
class Spec:
    doc: str
    contains: str  # a substring unique to the block in its doc
    kind: str = "run"  # run | server | skip | text | long
    reason: str = ""  # why skipped / what the text is / how it is checked
    needs: str | None = None  # the server the block runs against: readme | qwen3 | sdar | any | none
    lines: list[int] | None = None  # run only these lines of the block (the rest: `reason`)
    cut: str = ""  # kind long: without --long, run the block up to this text
    name: str = ""  # a server block: the name later blocks' `needs` give it
    per_line: bool = False  # a server block whose lines are alternative servers, started in turn
    ready: str = "health"  # how a server's page says it is ready: health | line
    expect: list[str] = field(default_factory=list)  # output lines the page shows in comments (verbatim)
    shown: bool = False  # the block after this one is its output, as the page shows it
    prose: bool = False  # ... with a sentence between them
    described: tuple[int, int] = (0, 0)  # the output's first and last lines that the prose describes, not shows
    volatile: list[tuple[str, str]] = field(default_factory=list)  # (shown text, regex) that vary per run
    check: Callable[[str, Path], str | None] | None = None  # another check: None when as documented
    pre: str = ""  # a command the page's prose says to run first
    file: str = ""  # the page says to save the Python block as this file, then run `command`
    command: str = ""  # how the page runs the Python block ({ray_address}: the current server's cluster)
    timeout: int = 900


def _no_error(out: str, clone: Path) -> str | None:
    bad = [ln for ln in out.splitlines() if '"error"' in ln]
    if bad:
        return f"an error answer: {bad[0][:200]}"
    if out.count("data: [DONE]") != 2:
        return f"{out.count('data: [DONE]')} streams ended with data: [DONE], expected 2"
    return None


def _trajectory_logprobs(out: str, clone: Path) -> str | None:
    rows = [[round(r[0], 4) for r in a["meta_info"]["output_token_logprobs"]] for a in json.loads(out)]
    first = [-0.0002, -0.0, -0.4879, -0.0053, -0.0955]
    return None if rows == [first, first + [-0.0]] else f"output_token_logprobs (rounded to 4 places) {rows}"


def _scoring_rows(out: str, clone: Path) -> str | None:
    rows = json.loads(out)["meta_info"]["input_token_logprobs"]
    if [r[1] for r in rows] != [17, 40, 41, 90] or any(len(r) != 3 or r[2] is not None for r in rows):
        return f"expected rows [value, id, null] for ids [17, 40, 41, 90], got {rows}"
    return None


def _http_200(out: str, clone: Path) -> str | None:
    return None if out.strip() == "200" else f"answered {out.strip()!r}, expected 200"


def _files(*names: str) -> Callable[[str, Path], str | None]:
    def check(out: str, clone: Path) -> str | None:
        missing = [n for n in names if not (clone / n).is_file()]
        return f"did not write {', '.join(missing)}" if missing else None
    return check


def _gpu_skips(out: str, clone: Path) -> str | None:
    lines = [ln for ln in out.splitlines() if ln.strip()]
    odd = [ln for ln in lines if '"skipped"' not in ln]
    return f"a line without 'skipped' on a machine without CUDA: {odd[0][:200]}" if odd or not lines else None


def _attention_timings(out: str, clone: Path) -> str | None:
    ok = re.fullmatch(r"torch \d+\.\d ms\nflex eager \d+\.\d ms", out.strip())
    return None if ok else f"expected 'torch N ms' then 'flex eager N ms', got {out.strip()[:200]!r}"


def _last_line(out: str) -> str:
    return out.strip().splitlines()[-1] if out.strip() else ""


def _pytest_passed(out: str, clone: Path) -> str | None:
    """pytest's summary: passed, none failed (the skips the docs name, e.g. the RL callers' tests
    without sglang, are allowed)."""
    last = _last_line(out)
    return f"pytest said: {last}" if " passed" not in last or re.search(r"failed|error", last) else None


def _viewer_test(out: str, clone: Path) -> str | None:
    last = _last_line(out)
    if "skipped" in last:  # the page says it makes the picture: Chromium is needed, and here
        return f"pytest said: {last}"
    return _pytest_passed(out, clone) or _files("docs/viewer.png")(out, clone)


def _training_unchanged(out: str, clone: Path) -> str | None:
    diff = subprocess.run(["git", "diff", "--stat", "--", "docs/training.md", "models"], cwd=clone,
                          capture_output=True, text=True).stdout
    return f"the rerun changed: {diff.strip()}" if diff.strip() else None


# How the pages run a Python block that joins the current server's cluster ({ray_address}: its address).
RAY_CLIENT = "RAY_AUTH_MODE=disabled RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_ADDRESS={ray_address} .venv/bin/python"
READY_PORT = [("41827", r"\d+")]  # the Ray cluster's port in a ready line the page shows
DEPLOY_READY = ("blockserve: application 'blockserve' ready at http://127.0.0.1:8000 on the Ray cluster at "
                "127.0.0.1:41827 (RAY_ADDRESS=127.0.0.1:41827 for Serve handles). Ctrl-C stops it.")
SPECS: list[Spec] = [
    # README.md
    Spec("README.md", "install -e '.[trace]'", "server", "README's first command", ready="health",
         name="readme"),
    Spec("README.md", "-e '.[test]' && RAY_AUTH_MODE=disabled .venv/bin/python -m pytest -q", "long",
         "the whole suite: about 29 min of pytest on 2 busy cores (--long runs it); the install before it "
         "runs here, and the fast tier below", cut=" && RAY_AUTH_MODE=disabled .venv/bin/python -m pytest -q",
         timeout=3000,
         check=_pytest_passed),
    Spec("README.md", "pytest -q -m engine", needs="none", check=_pytest_passed, timeout=2400),
    Spec("README.md", "until curl -sf localhost:8000/health", needs="readme",
         expect=['{"status":"ok","engine_replicas":1}']),
    Spec("README.md", '"copy [h,e,l,l,o] ->", "max_tokens": 24', needs="readme", shown=True),
    Spec("README.md", '"stream": true, "return_step_trace": true', needs="readme", shown=True),
    Spec("README.md", '{"text": ["23+58=", "45+67="]', needs="readme", shown=True),
    Spec("README.md", "blockserve serve --config configs/sdar-tiny.yaml", "server", ready="line", shown=True,
         name="sdar",
         volatile=READY_PORT),
    Spec("README.md", "ray.init(address=os.environ", needs="sdar", file="client.py",
         command=f"{RAY_CLIENT} client.py",
         expect=["112", "[220, 58] [1, 1]", "[220, 58, 18, 11, 19, 11] [1, 1, 2, 2, 2, 2]", "…"]),
    Spec("README.md", '"input_ids": [17, 18, 10, 20, 23, 28, 23, 16]', needs="qwen3", shown=True),
    Spec("README.md", '"echo": true}', needs="readme", shown=True,
         volatile=[("1796054546", r"\d+")]),
    Spec("README.md", "serve models/qwen3-tiny --logprobs-mode raw_logprobs --port 8000", "server",
         ready="line"),
    Spec("README.md", 'with pipeline("models/sdar-tiny"', shown=True),
    Spec("README.md", "--png docs/trace.png", shown=True, prose=True, described=(1, 1),
         check=_files("docs/trace.png"),
         reason="the step list compared; the coloured continuation before it and the line after, described"),
    Spec("README.md", "python3 -m webbrowser", "skip",
         "opens a browser window (no display here); docs/viewer.md's curl checks the page, "
         "tests/system/test_viewer.py drives it in headless Chromium"),
    # deployments/README.md
    Spec("deployments/README.md", "HTTP / handle", "text", "a diagram"),
    Spec("deployments/README.md", "export RAY_AUTH_MODE=disabled", "server", lines=[0, 1],
         reason="line 3, `ray start --head`, is skipped: it starts a persistent cluster that every "
         "address-less ray.init() on this machine then joins (the test suites running alongside included)"),
    Spec("deployments/README.md", '"prompt": "Hello", "max_tokens": 32', needs="qwen3", check=_no_error,
         reason="no output shown: checked that no answer is an error and both streams end with [DONE]"),
    Spec("deployments/README.md", "debug_stall.remote(30)", "skip",
         "a fault drill's handle call: it needs the drill application (build_drill_app), not the "
         "production one; tests/deployments/test_reliability_faults.py runs it"),
    Spec("deployments/README.md", 'body = h.generate.remote({"input_ids": [1, 2, 3]', needs="qwen3",
         command=f"{RAY_CLIENT} -"),
    # docs
    Spec("docs/adding-a-family.md", "engine/model/families/<name>/", "text", "a directory layout"),
    Spec("docs/api.md", '"dllm_trajectory": [{"output_ids"', needs="readme", check=_trajectory_logprobs,
         reason="compared with the values the prose gives, rounded to 4 places"),
    Spec("docs/api.md", '{"text": "…", "output_ids": [...]', "text", "the answer's schema"),
    Spec("docs/api.md", "from openai import OpenAI", needs="readme", expect=["81 [1, 1, 2]"],
         pre=".venv/bin/pip install -e '.[clients]'"),
    Spec("docs/architecture.md", "HTTP client / Ray handle", "text", "a diagram"),
    Spec("docs/benchmarks.md", "from ops.attention import AttentionMetadata", check=_attention_timings,
         reason="timings: checked the two lines' form, not their values"),
    Spec("docs/benchmarks.md", '"mode": "full"', "text", "a recorded bench report"),
    Spec("docs/benchmarks.md", '"mode": "quick"', "text", "a recorded bench report"),
    Spec("docs/decoding.md", "write_tiny_fast_dllm(\"/tmp/fast-dllm-tiny\"",
         expect=["[1, 2, 3, 4, 4, 4, 5, 6, 6, 5, 7, 8, 8, 8, 9, 9, 9, 9] 9"]),
    Spec("docs/decoding.md", 'write_tiny_llada2("/tmp/llada2-tiny"', expect=["[205, 76, 76] [3, 3, 3]"]),
    Spec("docs/deploy.md", "# like `vllm serve`", "server", per_line=True, ready="line",
         reason="each line in turn (lines 1-2: the ready line below; line 3: /health)"),
    Spec("docs/deploy.md", "blockserve: application 'blockserve' ready", "text", "the ready line of the block above"),
    Spec("docs/deploy.md", "blockserve serve: port 8000 on 127.0.0.1 is already in use", "text",
         "the output of a refusal the prose describes"),
    Spec("docs/deploy.md", "RuntimeError: The function deployments.single_machine", "text",
         "the output of a refusal the prose describes"),
    Spec("docs/deploy.md", "blockserve serve: model path '/models/sdar'", "text",
         "the output of refusals the prose describes"),
    Spec("docs/deploy.md", "cannot place Ingress replica 1", "text", "the output of a refusal the prose describes"),
    Spec("docs/deploy.md", "model: /models/my-sdar-checkpoint", "text", "a config fragment (tp=2 on CUDA)"),
    Spec("docs/deploy.md", "ray get-auth-token --generate", "skip", "several machines, with Ray's token auth"),
    Spec("docs/deploy.md", "ray.init(address=os.environ[\"RAY_ADDRESS\"])   # the cluster", needs="sdar",
         command=f"{RAY_CLIENT} -"),
    Spec("docs/gpu.md", "pip install -e '.[cuda]'", "skip", "needs a CUDA GPU (vllm and the CUDA torch it pins)"),
    Spec("docs/gpu.md", "hf download JetLM/SDAR-1.7B-Chat", "skip",
         "downloads a 1.7B checkpoint from the Hugging Face Hub (not reachable here), for the GPU"),
    Spec("docs/gpu.md", 'device="cuda"', "skip", "needs a CUDA GPU and the 1.7B checkpoint"),
    Spec("docs/gpu.md", ".venv/bin/python -m bench.gpu_check      #", check=_gpu_skips,
         reason="without CUDA each line says skipped, as its first comment says"),
    Spec("docs/migrate.md", "from lmdeploy import pipeline", "text", "a before/after pair of import lines"),
    Spec("docs/migrate.md", "Find the sum of all integer bases",
         reason="the page says it prints noise on the tiny model: checked exit 0"),
    Spec("docs/migrate.md", "from jetengine import LLM", "text", "a before/after pair of import lines"),
    Spec("docs/migrate.md", "llm.generate_streaming", expect=["[(0, '<|endoftext|>', [1])]"]),
    Spec("docs/migrate.md", "import_path: ray.serve.llm:build_openai_app", "text", "a before/after pair of "
         "config lines"),
    Spec("docs/migrate.md", "serve run configs/ray-serve-llm.yaml", "server", ready="health", name="llm"),
    Spec("docs/migrate.md", 'curl -s \'localhost:8000/health?model=qwen3-tiny\'', needs="current",
         expect=['{"status":"ok","models":{"sdar-tiny":{…},"qwen3-tiny":{…}}}',
                 '{"status":"ok","engine_replicas":1}']),
    Spec("docs/rl.md", "load_file(\"path/to/trained/model.safetensors\")", "skip",
         "a trainer's side: placeholder checkpoint paths"),
    Spec("docs/rl.md", "await engine.init_weights_update_group", "skip",
         "a trainer's side (a fragment: awaits in an async function, a trainer at 10.0.0.5)"),
    Spec("docs/rl.md", "world_size = rank_offset", "text", "a formula"),
    Spec("docs/rl.md", "pip install --no-deps sglang==0.5.23", timeout=1800),
    Spec("docs/rl.md", "bench.soak --iterations 200", lines=[0], pre=".venv/bin/pip install -e '.[bench]'",
         reason="lines 2-3 skipped: a 1.7B checkpoint with tp=2 for an hour, and a remote URL",
         needs="none", timeout=2400),
    Spec("docs/rollouts.md", "path/to/sdar-checkpoint", "skip", "a placeholder checkpoint path"),
    Spec("docs/scoring.md", '"input_ids": [1, 17, 40, 41, 90]', needs="qwen3", check=_scoring_rows,
         reason="compared with the prose: a row [value, id, null] per id of [17, 40, 41, 90]"),
    Spec("docs/scoring.md", '"prompt": [[...ctx + cont...]', "text", "a request body lm-eval-harness sends"),
    Spec("docs/training.md", "training.train_tiny --model sdar", "long",
         "retrains the shipped models (11 and 14 min on one core, then the evaluation; --long runs it)",
         needs="none", timeout=5400, check=_training_unchanged),
    Spec("docs/viewer.md", "python3 -m webbrowser", "skip", "opens a browser window (no display here)"),
    Spec("docs/viewer.md", "curl -s localhost:8000/viewer", needs="readme", check=_http_200),
    Spec("docs/viewer.md", "--json dynamic.json", check=_files("dynamic.json", "sequential.json")),
    Spec("docs/viewer.md", "sudo apt-get install -y chromium", "skip",
         "installs Debian packages with sudo (the walk's machine has no sudo; .ci/run installs the same two "
         "packages, and README's test command already installed the test extra)"),
    Spec("docs/viewer.md", "BLOCKSERVE_VIEWER_SCREENSHOT", needs="none", check=_viewer_test, timeout=1200),
    Spec("docs/reliability.md", "tests/deployments/test_reliability_*.py", needs="none", timeout=3000,
         reason="pytest's summary and bench.load's exit status"),
]


def spec_of(block: Block) -> Spec:
    """The block's entry of SPECS; for a block the table does not name, text for an untagged, json
    or yaml block, else run it."""
    found = [s for s in SPECS if s.doc == block.doc and s.contains in block.text]
    if len(found) > 1:
        raise SystemExit(f"{block.where}: more than one entry of SPECS matches: {[s.contains for s in found]}")
    if found:
        return found[0]
    if block.lang in ("json", "yaml", ""):
        return Spec(block.doc, "", "text", "output or data, not a command")
    return Spec(block.doc, "")


# --------------------------------------------------------------------------------------- comparison

def line_pattern(line: str) -> str:
    """One shown line as a regex: exact, except `…` (any text; a quoted string holding one: any
    string)."""
    out, i = [], 0
    while i < len(line):
        c = line[i]
        if c in "\"'" and line.find(c, i + 1) > 0:
            j = line.find(c, i + 1)
            quoted = line[i:j + 1]
            out.append(r"""(?:"[^"\n]*"|'[^'\n]*')""" if "…" in quoted else re.escape(quoted))
            i = j + 1
        else:
            out.append(r"[^\n]*?" if c == "…" else re.escape(c))
            i += 1
    return "".join(out)


def pattern(shown: str, volatile: list[tuple[str, str]]) -> re.Pattern[str]:
    """The shown text as a regex: its non-blank lines, each as `line_pattern`; a line that is only `…`
    stands for any lines; the volatile values (a per-run port, a timestamp) for what varies."""
    out = []
    for line in [ln.rstrip() for ln in shown.splitlines() if ln.strip()]:
        if line.strip() == "…":
            out.append(r"(?:[^\n]*\n)*?")
            continue
        rx = line_pattern(line)
        for text, value in volatile:
            rx = rx.replace(re.escape(text), value)
        out.append(rx + r"\n")
    return re.compile("".join(out))


def compare(actual: str, shown: list[str], volatile: list[tuple[str, str]]) -> str | None:
    """None when the non-blank lines of `actual` match the shown lines (`pattern`), else what it printed."""
    lines = "".join(ln.rstrip() + "\n" for ln in actual.splitlines() if ln.strip())
    if pattern("\n".join(shown), volatile).fullmatch(lines):
        return None
    return f"printed {lines.strip()[:400]!r}"


# -------------------------------------------------------------------------------------------- runner

def clean_env() -> dict[str, str]:
    """This process's environment for the docs' commands: without the Ray cluster and auth this process
    may have been given, its PYTHONPATH or its virtualenv (the clone's `.venv` is named by path), and
    unbuffered Python, so that a server's log shows its ready line as it prints it."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", "PYTHONPATH",
                                                          "VIRTUAL_ENV")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def port_taken(port: int = PORT) -> bool:
    """Whether something answers a connection on the port (a server this walk did not start)."""
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex(("127.0.0.1", port)) == 0


def port_bindable(port: int = PORT) -> bool:
    """Whether a server could listen on the port now: `blockserve serve`'s own check."""
    try:
        check_port_free("127.0.0.1", port)
    except PortInUseError:
        return False
    return True


def leftovers(clone: Path, wait: float) -> list[tuple[int, str]]:
    """(pid, name) of the processes still running in the clone (nothing else runs there between
    blocks) after up to `wait` seconds; Linux's /proc."""
    deadline = time.monotonic() + wait
    while True:
        left = []
        for d in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                if (d.name.isdigit() and int(d.name) != os.getpid() and os.readlink(d / "cwd") == str(clone)
                        and (d / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"):
                    left.append((int(d.name), (d / "comm").read_text().strip()))
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1)


def healthy() -> bool:
    """Whether the server on PORT answers /health with 200 now."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=5) as r:
            return r.status == 200
    except Exception:
        return False


@dataclass
class Server:
    """The server the walk has running in the background."""

    name: str  # what `Spec.needs` calls it (readme, qwen3, sdar, ...: `Spec.name`), else DOC:LINE#i
    proc: subprocess.Popen
    log: Path  # its stdout and stderr
    ray_address: str = ""  # the cluster its ready line names ('' for one waited on by /health)


@dataclass
class Row:
    """One row of walkthrough.md."""

    where: str  # DOC:LINE (or a server's log, for a stop that needed more than Ctrl-C)
    first: str  # the command's first line
    status: str  # ran / skipped / not a command, and why
    rc: str = ""
    seconds: str = ""
    verdict: str = ""
    ok: bool = True


class Walk:
    """The walk through the blocks in the clone: the server it has running, and the rows so far."""

    def __init__(self, clone: Path, logs: Path, long: bool) -> None:
        self.clone, self.logs, self.long = clone, logs, long
        self.server: Server | None = None
        self.rows: list[Row] = []
        self.logs_written = 0  # numbers the logs, in walk order
        self.readme_first = ""  # README's first command: the "readme" server

    # ----- processes
    def _log(self, where: str, suffix: str) -> Path:
        self.logs_written += 1
        return self.logs / f"{self.logs_written:03d}-{where.replace('/', '_').replace(':', '-')}.{suffix}"

    def shell(self, text: str, where: str, timeout: int, stdin: str | None = None) -> tuple[int, str, float]:
        """Run `text` with bash -e -o pipefail in the clone, Ctrl-C after `timeout` s (exit status 124);
        (exit status, stdout, seconds), stdout and stderr logged."""
        log = self._log(where, "log")
        t0 = time.monotonic()
        p = subprocess.run(["timeout", "-s", "INT", "-k", "30", str(timeout), "bash", "-e", "-o", "pipefail",
                            "-c", text], cwd=self.clone, env=clean_env(), input=stdin, capture_output=True,
                           text=True, start_new_session=True)
        rc, out, err = p.returncode, p.stdout, p.stderr
        log.write_text(f"$ {text}\n--- stdout\n{out}\n--- stderr\n{err}")
        return rc, out, time.monotonic() - t0

    def start(self, name: str, text: str, where: str, ready: str, cap: int = 2400) -> tuple[Server | None, str]:
        """Start `text` in the background (its own process group, as a shell's foreground job) and wait
        for it the way its page says: /health 200 (README's loop) or the ready line."""
        self.stop()
        if port_taken():
            return None, f"port {PORT} is taken by a process this walk did not start"
        log = self._log(where, "server.log")
        with log.open("w") as fh:  # the server writes to its own copy of the file
            fh.write(f"$ {text}\n")
            fh.flush()
            proc = subprocess.Popen(["bash", "-c", text], cwd=self.clone, env=clean_env(), stdout=fh,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        server = Server(name, proc, log)
        self.server = server
        deadline = time.monotonic() + cap
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return None, f"the server exited ({proc.returncode}) before it was ready; see {log.name}"
            if ready == "line":
                m = READY_LINE.search(log.read_text())
                if m:
                    server.ray_address = m[2]
                    return server, ""
            elif healthy():
                # the README's own loop, now answering at once
                rc, out, _ = self.shell(HEALTH_LOOP, where + "-ready", 120)
                return (server, "") if rc == 0 else (None, f"the health loop failed: {out}")
            time.sleep(1)
        return None, f"not ready after {cap} s"

    def stop(self) -> None:
        """Ctrl-C to the server's process group, as in its shell; harder only if it does not go, and
        then a row says so (the docs say Ctrl-C stops the server and the cluster it started)."""
        server, self.server = self.server, None
        if server is None:
            return
        used = ""
        for sig, wait in ((signal.SIGINT, 120), (signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            if server.proc.poll() is not None:
                break
            used = sig.name
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.proc.wait(wait)
        exited = time.monotonic()
        while not port_bindable() and time.monotonic() - exited < 120:
            time.sleep(1)
        freed = time.monotonic() - exited
        left = leftovers(self.clone, max(0.0, 60 - freed))  # Ray's workers run in process groups of their own
        for pid, _ in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        rc = server.proc.returncode
        with server.log.open("a") as fh:
            fh.write(f"\n--- stopped with {used or 'nothing (it had exited)'}: exit status {rc}; port {PORT} "
                     f"could be bound again {freed:.0f} s after it exited; {len(left)} processes left\n")
        forced = used not in ("", "SIGINT")
        if forced or left:
            why = (f"{used} was needed" if forced else
                   f"{len(left)} of its processes were left a minute later (killed): {left[0][1]}")
            self.rows.append(Row(server.log.name, f"Ctrl-C to {server.name}", "stopped", str(rc), "", why, ok=False))

    def need(self, name: str | None, where: str) -> str:
        """Make `name` the running server; '' when it is, else why not."""
        if name is None or name == "any" or (name == "current" and self.server):
            return ""
        if name == "current":
            return "no server is running"
        if name == "none":
            self.stop()
            return ""
        if self.server and self.server.name == name and self.server.proc.poll() is None:
            return ""
        if name == "readme":
            _, why = self.start("readme", self.readme_first, where + "-readme", "health")
        else:
            _, why = self.start(name, SERVERS[name], where + f"-{name}", "line")
        return why

    # ----- one block
    def add(self, block: Block, status: str, rc: str = "", seconds: str = "", verdict: str = "",
            ok: bool = True) -> None:
        """A row for the block."""
        self.rows.append(Row(block.where, block.first_line, status, rc, seconds, verdict, ok))

    def run_block(self, block: Block, blocks: list[Block]) -> None:
        """Do with the block what its spec says, and add its row."""
        spec = spec_of(block)
        if spec.kind == "text":
            self.add(block, f"not a command: {spec.reason}")
            return
        if spec.kind == "skip" or (spec.kind == "long" and not self.long and not spec.cut):
            self.add(block, f"skipped: {spec.reason}")
            return
        for e in spec.expect:
            assert e in block.text, f"{block.where}: {e!r} is not what the page shows"
        text = block.text
        note = f" ({spec.reason})" if spec.reason else ""
        if spec.kind == "long" and not self.long:
            text = text.split(spec.cut)[0]
            note = f" (up to `{spec.cut.strip()}`: {spec.reason})"
        elif spec.lines is not None:
            text = "\n".join(block.text.splitlines()[i] for i in spec.lines)
        shown = shown_after(self.clone, block, blocks, spec.prose) if spec.shown else None
        if spec.kind == "server":
            self.run_servers(block, spec, text, shown, note)
            return
        why = self.need(spec.needs, block.where)
        if why:
            self.add(block, "ran", "", "", f"its server did not start: {why}", ok=False)
            return
        if spec.pre:
            rc, out, secs = self.shell(spec.pre, block.where + "-pre", 1800)
            if rc:
                self.add(block, f"ran `{spec.pre}` first", str(rc), f"{secs:.0f}", "the install failed", ok=False)
                return
            note += f" (first `{spec.pre}`, as the page's prose says)"
        command, stdin = text, None
        address = self.server.ray_address if self.server else ""
        if block.lang == "python":
            if spec.file:
                (self.clone / spec.file).write_text(block.text)
            else:
                stdin = block.text
            command = (spec.command or ".venv/bin/python -").format(ray_address=address)
            note += f" (as `{command}`{' < the block' if stdin else ''})"
        rc, out, secs = self.shell(command, block.where, spec.timeout, stdin)
        partial = spec.kind == "long" and not self.long  # its check is the whole block's
        verdict = self.judge(rc, out, Spec(spec.doc, "", timeout=spec.timeout) if partial else spec, shown)
        self.add(block, "ran" + note, str(rc), f"{secs:.0f}", verdict or "as documented", ok=verdict is None)

    def judge(self, rc: int, out: str, spec: Spec, shown: Block | None) -> str | None:
        """None when the block answered as its page says (exit 0, then the shown output, the expected
        lines and the spec's check, on the output less its `described` lines), else what it did."""
        if rc == 124:
            return f"timed out after {spec.timeout} s"
        if rc != 0:
            return f"exit status {rc}"
        lines = [ln for ln in out.splitlines() if ln.strip()]
        out = "\n".join(lines[spec.described[0]:len(lines) - spec.described[1]])
        return ((shown and compare(out, [shown.text], spec.volatile))
                or (spec.expect and compare(out, spec.expect, spec.volatile))
                or (spec.check and spec.check(out, self.clone)) or None)

    def run_servers(self, block: Block, spec: Spec, text: str, shown: Block | None, note: str) -> None:
        """Start the block as a server and leave it running for the blocks after it; a block of
        alternative servers (`per_line`): each in turn, stopped before the next."""
        texts = [ln for ln in text.splitlines() if ln.strip()] if spec.per_line else [text]
        for i, t in enumerate(texts):
            # Serve's own CLI (`serve run`) prints no blockserve ready line: it is ready at /health 200
            ready = "health" if spec.per_line and "serve run" in t else spec.ready
            t0 = time.monotonic()
            server, why = self.start(spec.name or f"{block.where}#{i}", t, block.where, ready)
            row = Row(block.where + (f" line {i + 1}" if spec.per_line else ""), t.split("  #")[0].strip(),
                      f"ran in the background, until ready{note}", "", f"{time.monotonic() - t0:.0f}")
            self.rows.append(row)
            if server is None:
                row.verdict, row.ok = why, False
                continue
            row.verdict = "ready as documented" + (" (/health 200)" if ready == "health" else "")
            if ready == "line":
                line = next(ln for ln in server.log.read_text().splitlines() if READY_LINE.search(ln))
                bad = compare(line, [shown.text if shown else DEPLOY_READY], READY_PORT)
                row.verdict += "" if bad is None else f"; the ready line {bad}"
                row.ok = bad is None
            if spec.per_line:
                self.stop()
                row.rc = str(server.proc.returncode)
                row.verdict += f"; Ctrl-C: exit status {server.proc.returncode}"


# -------------------------------------------------------------------------------------------- report

def report(rows: list[Row], path: Path, head: str) -> None:
    """Write walkthrough.md: `head`, then a table of the rows, the ones not as documented in bold."""
    def cell(s: str) -> str:
        return s.replace("|", "\\|").replace("\n", " ")

    out = [head, "", "| block | command (first line) | ran / skipped | exit | s | verdict |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        first = r.first if len(r.first) <= 90 else r.first[:87] + "..."
        out.append(f"| {r.where} | `{cell(first)}` | {cell(r.status)} | {r.rc} | {r.seconds} | "
                   f"{cell(r.verdict) if r.ok else '**' + cell(r.verdict) + '**'} |")
    path.write_text("\n".join(out) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="the clone, the logs and walkthrough.md go here (all but --list)")
    ap.add_argument("--only", action="append", default=[], help="only this doc (repeatable), e.g. docs/api.md")
    ap.add_argument("--from", dest="start", default="", help="start at this block, DOC:LINE")
    ap.add_argument("--reuse", action="store_true", help="keep DIR/clone if it is there (no fresh clone)")
    ap.add_argument("--long", action="store_true", help="also the whole test suite and the retraining")
    ap.add_argument("--list", action="store_true", help="print what would be done with each block, run nothing")
    args = ap.parse_args(argv)
    # Ctrl-C for this walk, and for the servers it starts: a shell's background job (`cmd &`) ignores
    # SIGINT, and its children would inherit that and outlive the Ctrl-C the docs stop them with
    signal.signal(signal.SIGINT, signal.default_int_handler)
    blocks = [b for doc in doc_paths(ROOT) for b in extract(ROOT, doc)]
    unused = [f"{s.doc}: {s.contains!r}" for s in SPECS
              if sum(s.doc == b.doc and s.contains in b.text for b in blocks) != 1]
    if unused:
        print("entries of SPECS that match no block, or several:", *unused, sep="\n  ", file=sys.stderr)
        return 2
    if args.list:
        for b in blocks:
            spec = spec_of(b)
            print(f"{b.where:32} {spec.kind:6} {spec.needs or '':7} {b.first_line[:70]}  {spec.reason[:60]}")
        return 0

    if args.out is None:
        ap.error("--out DIR is needed to run the walk")
    out = args.out.resolve()
    clone, logs = out / "clone", out / "logs"
    if port_taken():
        print(f"port {PORT} is in use: the docs' servers listen there; stop what holds it first", file=sys.stderr)
        return 2
    logs.mkdir(parents=True, exist_ok=True)
    if args.reuse and clone.is_dir():  # walk this repository's HEAD in the clone already installed
        subprocess.run(["git", "pull", "-q", "--ff-only"], cwd=clone, check=True)
    else:
        if clone.exists():
            print(f"{clone} exists: remove it, or pass --reuse", file=sys.stderr)
            return 2
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=clone, capture_output=True, text=True).stdout.strip()

    blocks = [b for doc in doc_paths(clone) for b in extract(clone, doc)]
    walk = Walk(clone, logs, args.long)
    first = next(b for b in blocks if b.doc == "README.md")
    walk.readme_first = first.text.strip()
    selected = [b for b in blocks if not args.only or b.doc in args.only]
    if args.start:
        at = next(i for i, b in enumerate(selected) if b.where == args.start)
        selected = selected[at:]
    shown_blocks: set[int] = set()  # ids of the blocks that are the output a page shows for the block above them
    for b in blocks:
        spec = spec_of(b)
        if spec.shown and (s := shown_after(clone, b, blocks, spec.prose)):
            shown_blocks.add(id(s))
    t0 = time.monotonic()
    try:
        for block in selected:
            if id(block) in shown_blocks:
                walk.add(block, "not a command: the output the page shows for the block above")
                continue
            print(f"[{time.monotonic() - t0:6.0f} s] {block.where}: {block.first_line[:100]}", flush=True)
            walk.run_block(block, blocks)
            r = walk.rows[-1]
            print(f"         {r.status[:60]} {r.rc} {r.verdict[:200]}", flush=True)
            report(walk.rows, out / "walkthrough.md", f"# Docs walkthrough of {commit}")
    finally:
        walk.stop()
    ran = [r for r in walk.rows if r.status.startswith("ran")]
    bad = [r for r in walk.rows if not r.ok]
    command = shlex.join([".venv/bin/python", "-m", "tools.docs_walkthrough", *(argv or sys.argv[1:])])
    head = (f"# Docs walkthrough of {commit}\n\n`{command}`, {time.monotonic() - t0:.0f} s: {len(walk.rows)} rows, "
            f"{len(ran)} run, {len(bad)} not as documented.")
    report(walk.rows, out / "walkthrough.md", head)
    print(head)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
