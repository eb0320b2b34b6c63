"""README's test command, on a fresh clone, installs what every family's tests need, so that none of them skips
for a package (only for a browser or a GPU the machine lacks): every optional module a test skips without, and
everything .ci/run installs before it runs the same pytest command (sglang and areal without their dependencies,
which pin another torch: SGLang's released InDel rule is the oracle of the LLaDA2.2 tests, and the trainers'
own clients drive the app; then what their modules import, tests/requirements-callers.txt)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import tomllib

from tests.support.paths import ROOT

SEPARATORS = {"&&", "||", ";", "|", "&"}


def _commands(script: str) -> list[list[str]]:
    """The simple commands of a shell script (backslash continuations joined, comments, redirections and
    leading VAR=value assignments dropped)."""
    out: list[list[str]] = []
    for line in script.replace("\\\n", " ").splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split, lex.commenters = True, "#"
        argv: list[str] = []
        for token in [*lex, ";"]:
            if token in SEPARATORS or token in ("{", "}", "(", ")"):
                while argv and re.fullmatch(r"\w+=.*", argv[0]):
                    argv.pop(0)
                if argv:
                    out.append(argv)
                argv = []
            elif token in (">", ">>", "<") or (argv and argv[-1] in (">", ">>", "<")):
                argv.append(">")  # the redirection and its target: dropped below
            else:
                argv.append(token)
    commands = [[a for a in argv if a != ">" and not re.fullmatch(r"\d?>&\d", a)] for argv in out]
    return [argv for argv in commands if argv]


def _installs(commands: list[list[str]]) -> list[tuple[str, ...]]:
    """The arguments of each `pip install`, quiet flags left out."""
    return [tuple(a for a in argv[2:] if a not in ("-q", "--quiet")) for argv in commands
            if Path(argv[0]).name == "pip" and argv[1:2] == ["install"]]


def readme_test_command() -> list[list[str]]:
    """README's 'Install and run the tests' command."""
    text = (ROOT / "README.md").read_text()
    blocks = [m[1] for m in re.finditer(r"^```bash\n(.*?)^```", text, re.M | re.S)
              if "-e '.[test]'" in m[1] and "pytest -q" in m[1]]
    assert len(blocks) == 1, blocks
    return _commands(blocks[0])


def _requirement_names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[ ;]", r.strip(), maxsplit=1)[0].lower().replace("_", "-")
            for r in requirements if r.strip() and not r.strip().startswith("#")}


def installed_by(installs: list[tuple[str, ...]]) -> set[str]:
    """The distributions those `pip install`s name: the project's dependencies and the extras it names,
    requirement files, and packages named directly."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names: set[str] = set()
    for args in installs:
        for i, arg in enumerate(args):
            if arg.startswith("-") or (i and args[i - 1] == "-r"):
                if i and args[i - 1] == "-r":
                    names |= _requirement_names((ROOT / arg).read_text().splitlines())
                continue
            extras = re.fullmatch(r"\.\[([\w,-]+)\]", arg)
            if extras:
                names |= _requirement_names(project["dependencies"])
                for extra in extras[1].split(","):
                    names |= _requirement_names(project["optional-dependencies"][extra])
            elif arg != ".":
                names |= _requirement_names([arg])
    return names


def test_readme_installs_every_module_a_test_skips_without():
    """`pytest.importorskip("X")` / `find_spec("X")` in a test: README's test command installs X's package
    (sglang for the LLaDA2.2 tests and sglang's bench client, areal for AReaL's client, sglang-router, ...)."""
    dists = {"sglang_router": "sglang-router", "ray": "ray"}  # module -> distribution, where they differ
    wanted = {}
    for f in sorted(set(ROOT.glob("tests/**/*.py")) - {Path(__file__).resolve()}):
        for module in re.findall(r"""(?:importorskip|find_spec)\(\s*["']([\w.]+)["']""", f.read_text()):
            top = module.split(".")[0]
            wanted.setdefault(dists.get(top, top).lower().replace("_", "-"), f.name)
    assert {"sglang", "areal"} <= set(wanted), wanted
    installed = installed_by(_installs(readme_test_command()))
    missing = {dist: test for dist, test in wanted.items() if dist not in installed}
    assert missing == {}, f"README's test command does not install what these tests skip without: {missing}"


def test_readme_installs_what_ci_installs_before_the_same_pytest_command():
    """.ci/run runs README's test command: every `pip install` it makes, README's command makes too, before
    its pytest run."""
    ci = _installs(_commands((ROOT / ".ci" / "run").read_text()))
    readme = readme_test_command()
    assert Path(readme[-1][0]).name == "python" and readme[-1][1:4] == ["-m", "pytest", "-q"], readme[-1]
    missing = [args for args in ci if args not in _installs(readme)]
    assert missing == [], f"README's test command lacks these installs of .ci/run: {missing}"
