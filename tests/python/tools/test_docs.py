"""What a reader of the documents meets: the product's own words (no ticket numbers in the
documents or in code comments), and commands that exist. Every command README.md's "On a fresh
machine" and docs/benchmarks.md's "Reproduce" quote is checked as far as it can be without
running it: its scripts exist and parse (``bash -n``), its Python programs build their parser
and accept the quoted flags, its C++ binaries are targets CMake builds."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_DIRS = ("csrc", "python", "tests", "benchmarks", ".ci")
CODE_SUFFIXES = {".py", ".cc", ".h", ".cu", ".cuh", ".cpp", ".sh", ".txt", ".toml", ""}

# "issue 23", "Issue 26, item 3", "issues 21, 22", "issue-8", "issue #40". An upstream thread
# is cited by its address (github.com/owner/repo/issues/N) or as owner/repo#N, which this
# does not match.
TICKET = re.compile(r"\bissues?[\s-]*#?\d+", re.IGNORECASE)
# How the work was organised, which is no reader's business.
PROCESS = re.compile(
    r"\b(this|next|a later|later|previous|earlier|the last) session\b|\bGPU-truth\b",
    re.IGNORECASE,
)
# Notes kept outside this repository, which its reader cannot open.
OUTSIDE = re.compile(r"shared/reference|\bANCHORS\.md|\bENGINES\.md|\.library/")
# The documents whose commands a new user copies.
QUOTED = [(ROOT / "README.md", "On a fresh machine"), (ROOT / "docs/benchmarks.md", "Reproduce")]
# Programs a quoted command may run that are not this project's: present on the machine .ci/setup
# prepares.
EXTERNAL = {"cd", "cmake", "ctest", "pip", "git", "nvidia-smi", "export", "ls", "cat"}


def _sources() -> Iterator[Path]:
    for top in CODE_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            if path.suffix in CODE_SUFFIXES or path.name == "CMakeLists.txt":
                yield path
    yield ROOT / "CMakeLists.txt"


def _hits(pattern: re.Pattern[str], paths: list[Path]) -> list[str]:
    hits = []
    for path in paths:
        if not path.exists():
            continue
        # The whole text: code that names a ticket is as visible to its reader as a comment.
        text = path.read_text(encoding="utf-8", errors="replace")
        for n, line in enumerate(text.splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    return hits


def test_documents_and_code_comments_name_no_ticket_numbers():
    hits = _hits(TICKET, [p for p in DOCS if p.exists()] + list(_sources()))
    hits = [h for h in hits if not h.startswith("tests/python/tools/test_docs.py:")]
    assert not hits, "say what the product does and why, not which ticket:\n" + "\n".join(hits)


def test_documents_do_not_speak_of_how_the_work_was_organised():
    hits = _hits(PROCESS, [p for p in DOCS if p.exists()])
    assert not hits, "\n".join(hits)


def test_documents_and_code_cite_nothing_outside_the_repository():
    hits = _hits(OUTSIDE, [p for p in DOCS if p.exists()] + list(_sources()))
    hits = [h for h in hits if not h.startswith("tests/python/tools/test_docs.py:")]
    assert not hits, "cite what a reader of this repository can open:\n" + "\n".join(hits)


# ------------------------------------------------------------------ quoted commands


def _section(text: str, heading: str) -> str:
    """The body of the level-2 section whose heading starts with ``heading``."""
    match = re.search(rf"^## {re.escape(heading)}[^\n]*\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"no '## {heading}' section"
    return match.group(1)


def quoted_commands(text: str) -> list[str]:
    """Each command of the section's bash blocks: continuation lines joined, comments and
    blank lines dropped, and ``&&``/``||``/``;``/``|`` chains split into their commands."""
    commands = []
    for block in re.findall(r"^```(?:bash|sh|console)\n(.*?)^```", text, re.M | re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip().removeprefix("$ ")
            if not line or line.startswith("#"):
                continue
            commands += [c.strip() for c in re.split(r"&&|\|\||;|\|", line) if c.strip()]
    return commands


def _load_script(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"quoted_{path.stem}", path)
    assert spec and spec.loader, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parses(parser: argparse.ArgumentParser, args: list[str], command: str) -> None:
    try:
        parser.parse_args(args)
    except SystemExit as e:  # argparse's way of refusing (it printed why on stderr)
        pytest.fail(f"{command!r}: its program refuses these arguments (exit {e.code})")


def _cmake_targets() -> set[str]:
    text = "\n".join(
        p.read_text() for p in [ROOT / "CMakeLists.txt", *ROOT.glob("**/cmake/*.cmake")]
    )
    return set(re.findall(r"add_executable\(\s*([\w-]+)", text))


def check_command(command: str) -> None:
    """Fails the test when ``command`` names a program that does not exist or flags its
    parser does not take. Runs nothing."""
    if "$(" in command or "`" in command:
        pytest.fail(f"{command!r}: a substitution cannot be checked; quote the plain command")
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        words.pop(0)  # an environment assignment
    assert words, command
    program, args = words[0], words[1:]
    if program == "bash":
        script = ROOT / args[0]
        assert script.is_file(), f"{command!r}: no {args[0]}"
        subprocess.run(["bash", "-n", str(script)], check=True)
    elif Path(program).name == "pcie-allreduce":
        from pcie_allreduce.cli import build_parser

        _parses(build_parser(), args, command)
    elif Path(program).name in ("python", "python3"):
        if args[0] == "-m":
            module = importlib.import_module(args[1])
            rest = args[2:]
        else:
            script = ROOT / args[0]
            assert script.is_file(), f"{command!r}: no {args[0]}"
            module = _load_script(script)
            rest = args[1:]
        build = getattr(module, "build_parser", None)
        assert build is not None, f"{command!r}: {module.__name__} has no build_parser()"
        _parses(build(), rest, command)
    elif program.startswith("build/"):
        assert Path(program).name in _cmake_targets(), f"{command!r}: no CMake target of that name"
    else:
        assert program in EXTERNAL, f"{command!r}: {program} is neither this project's nor known"


@pytest.mark.parametrize("document, heading", QUOTED, ids=[f"{d.name}:{h}" for d, h in QUOTED])
def test_every_quoted_command_exists_and_its_flags_parse(document, heading):
    commands = quoted_commands(_section(document.read_text(), heading))
    assert commands, f"{document.name} '## {heading}' quotes no command"
    for command in commands:
        check_command(command)


def test_the_check_refuses_what_does_not_exist():
    """The checks above can fail: a flag no parser takes, a missing script, a missing target."""
    text = "```bash\nbash .ci/setup && .venv/bin/pcie-allreduce bench --world 2 \\\n --no-such\n```"
    first, second = quoted_commands(text)
    assert first == "bash .ci/setup"
    check_command(first)
    bad = [
        second,
        ".venv/bin/python benchmarks/no_such_benchmark.py",
        "bash .ci/no_such_script",
        "build/cmake/no_such_binary --x",
        "curl https://example.com",
    ]
    for command in bad:
        with pytest.raises((pytest.fail.Exception, AssertionError)):
            check_command(command)
    assert TICKET.search("the epilogue (issue 24)") and TICKET.search("Issue 26, item 3:")
    assert not TICKET.search("vllm-project/vllm#50941") and not TICKET.search("issues/12 of")
    assert OUTSIDE.search("(shared/reference/ENGINES.md)") and not OUTSIDE.search("docs/design.md")


def test_generated_tables_match_what_their_sources_print_now():
    """docs/benchmarks.md's generated tables: every marker has a spec, and the deterministic
    ones (the cost model's, and the summary built from the others) are what their sources print
    today, so a change to the model cannot leave the document behind."""
    import sys

    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks/tables.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_documents_reaches_a_file_and_heading():
    broken = []
    for doc in [p for p in DOCS if p.exists()] + [ROOT / "benchmarks/README.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            linked = (doc.parent / path).resolve() if path else doc
            if not linked.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}: no such file")
            elif anchor and linked.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), re.M)
                if anchor not in {_slug(h) for h in headings}:
                    broken.append(f"{doc.relative_to(ROOT)}: {target}: no such heading")
    assert not broken, "\n".join(broken)
    assert _slug("## GPUs without P2P: `cuda_host`".lstrip("# ")) == "gpus-without-p2p-cuda_host"
