"""CPU tests of the documentation: docstrings of the public API, docs/api.md against the code,
the README's commands (the two a newcomer runs, the same as CI's) and the links between docs."""
from __future__ import annotations

import ast
import copy
import inspect
import re
import shlex
from pathlib import Path

import click
import pytest

import cupyops
from cupyops import fx
from cupyops.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
API = ROOT / "docs" / "api.md"


def _fenced_blocks(text: str, language: str = "") -> list:
    """The fenced code blocks of a Markdown text (of one language where named), as text."""
    pattern = rf"^ *```{re.escape(language)}[^\n]*\n(.*?)^ *```" if language else r"^ *```[^\n]*\n(.*?)^ *```"
    return re.findall(pattern, text, flags=re.M | re.S)


def _signature(function) -> str:
    """name(parameters) as docs/api.md writes it: no annotations."""
    signature = inspect.signature(function)
    parameters = [p.replace(annotation=inspect.Parameter.empty) for p in signature.parameters.values()]
    return f"{function.__name__}{signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty)}"


def _torch_public() -> list:
    """(name, signature or None, docstring) of each public function and class of cupyops/torch.py,
    read from its source (torch need not be installed). Classes without an __init__ of their own
    (drop-in torch modules) have no signature here."""
    tree = ast.parse((ROOT / "cupyops" / "torch.py").read_text())

    def definitions(body):
        for node in body:
            if isinstance(node, ast.If):
                yield from definitions(node.body)
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                yield node

    found = []
    for node in definitions(tree.body):
        if isinstance(node, ast.ClassDef):
            init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            arguments = None if init is None else copy.deepcopy(init.args)
            if arguments is not None:
                arguments.args = arguments.args[1:]      # self
        else:
            arguments = copy.deepcopy(node.args)
        signature = None
        if arguments is not None:
            for argument in arguments.posonlyargs + arguments.args + arguments.kwonlyargs:
                argument.annotation = None
            signature = f"{node.name}({ast.unparse(arguments)})"
        found.append((node.name, signature, ast.get_docstring(node)))
    return found


def _api_section(module: str) -> str:
    """The part of docs/api.md under the heading ## `module`."""
    text = API.read_text()
    match = re.search(rf"^## `{re.escape(module)}`\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"docs/api.md has no section ## `{module}`"
    return match.group(1)


# -- docstrings ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", cupyops.__all__)
def test_public_name_has_a_docstring(name):
    assert (inspect.getdoc(getattr(cupyops, name)) or "").strip(), f"cupyops.{name} has no docstring"


@pytest.mark.parametrize("name", sorted(fx.NAMESPACE))
def test_fx_function_has_a_docstring(name):
    assert (inspect.getdoc(fx.NAMESPACE[name]) or "").strip(), f"cupyops.fx {name} has no docstring"


def test_torch_public_names_have_docstrings():
    names = [name for name, _, _ in _torch_public()]
    assert {"softmax", "layer_norm", "rms_norm", "LayerNorm", "RMSNorm"} <= set(names)
    assert [name for name, _, doc in _torch_public() if not (doc or "").strip()] == []


# -- docs/api.md against the code ---------------------------------------------------------------

@pytest.mark.parametrize("name", cupyops.__all__)
def test_api_md_lists_each_public_name_with_its_signature(name):
    obj = getattr(cupyops, name)
    text = _api_section("cupyops")
    entry = f"`{name}`" if inspect.ismodule(obj) else f"`{_signature(obj)}`"
    assert entry in text, f"docs/api.md (## `cupyops`) lacks {entry}"


@pytest.mark.parametrize("name", sorted(fx.NAMESPACE))
def test_api_md_lists_each_fx_function_with_its_signature(name):
    entry = f"`{_signature(fx.NAMESPACE[name])}`"
    assert entry in _api_section("cupyops.fx"), f"docs/api.md (## `cupyops.fx`) lacks {entry}"


def test_api_md_lists_each_torch_name_with_its_signature():
    text = _api_section("cupyops.torch")
    for name, signature, _ in _torch_public():
        entry = f"`{signature}`" if signature else f"`{name}`"
        assert entry in text, f"docs/api.md (## `cupyops.torch`) lacks {entry}"


# -- README ----------------------------------------------------------------------------------

def test_readme_is_short():
    lines = README.read_text().splitlines()
    assert len(lines) < 150, f"README.md has {len(lines)} lines"


def test_readme_opens_with_the_two_commands_ci_runs():
    first = _fenced_blocks(README.read_text())[0]
    install_and_bench, test = [line for line in first.splitlines() if line.strip()]   # exactly two
    install, bench = install_and_bench.split(" && ")
    requirement = re.fullmatch(r'pip install "(\.\[[a-z0-9_,]+\])"', install)
    assert requirement, install
    assert "test" in requirement.group(1) and bench.startswith("cupyops bench ")
    assert test.startswith("python -m pytest") and test.endswith(" tests")
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf'pip install (--\S+ )*"{re.escape(requirement.group(1))}"$', ci, flags=re.M), \
        ".ci/run installs something else than the README's first command"
    assert test in ci.splitlines(), ".ci/run runs another test command than the README's"


def test_the_test_extra_installs_what_the_tests_need():
    tomllib = pytest.importorskip("tomllib", reason="tomllib (Python 3.11+) reads pyproject.toml")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    needed = {re.split(r"[<>=!~ \[]", requirement)[0] for requirement in extras["test"]}
    assert {"pytest", "pytest-xdist", "scipy", "matplotlib"} <= needed


def test_readme_names_only_what_cupyops_has():
    code = "\n".join(_fenced_blocks(README.read_text(), "python"))
    names = set(re.findall(r"\bcupyops\.(\w+)", code))
    assert names, "no cupyops.NAME in the README's Python"
    optional = {"torch"}         # submodule needing torch: checked through its source
    missing = sorted(name for name in names - optional if not hasattr(cupyops, name))
    assert missing == []
    torch_names = {name for name, _, _ in _torch_public()}
    assert set(re.findall(r"\bcot\.(\w+)", code)) <= torch_names


def _cli_lines(path: Path) -> list:
    lines = []
    for block in _fenced_blocks(path.read_text(), "bash"):
        for line in block.splitlines():
            for command in line.split("#")[0].split("&&"):
                if command.strip().startswith("cupyops "):
                    lines.append(command.strip())
    return lines


@pytest.mark.parametrize("line", _cli_lines(README) + _cli_lines(ROOT / "docs" / "cli.md"))
def test_documented_commands_parse(line):
    """Each `cupyops ...` line of the README and docs/cli.md names a real command and options
    it takes (parsed, not run: bench needs a GPU)."""
    args = shlex.split(line)[1:]
    command, path = main, ["cupyops"]
    while isinstance(command, click.Group):
        assert args, f"{line!r} names no subcommand of {' '.join(path)}"
        sub = command.get_command(click.Context(command), args[0])
        assert sub is not None, f"no command {args[0]!r} in {line!r}"
        command, path, args = sub, [*path, args.pop(0)], args
    command.make_context(" ".join(path), args)      # a usage error on an unknown option or bad value


# -- links --------------------------------------------------------------------------------------

def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", [README, *sorted((ROOT / "docs").glob("*.md"))], ids=lambda p: p.name)
def test_relative_links_point_to_files_that_exist(page):
    text = re.sub(r"^ *```.*?^ *```", "", page.read_text(), flags=re.M | re.S)    # not in code
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", linked.read_text(), flags=re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert broken == [], f"{page.name}: broken links {broken}"
