"""The documentation holds to the code: the key table of docs/config.md is the job schema, every
relative link of README.md and docs/*.md resolves (file and heading), every command the docs show
exists (a Makefile target or variable, a `vlmcp` sub-command and its options, a `python -m`
module), and every repository path they name is there.

No processes and no model: the markdown files, the Makefile, the job schema and the argument parser.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from vlmcp.cli import build_parser
from vlmcp.config import schema_fields

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
PAGES = [README, *DOCS]
#: "about 200 lines" (issue 14): a landing page, with room for a few more feature lines.
README_MAX_LINES = 220
#: Top-level names of the repository that a path in the docs may start with.
REPO_ROOTS = ("vlmcp", "tests", "launch", "ds_configs", "scripts", "docs", ".ci")
#: Subpackages the docs name relative to vlmcp/ (`model/loss.py`).
PACKAGE_DIRS = ("model", "parallel", "training", "data", "config", "bench", "demo")
#: Fenced code blocks whose lines are shell commands.
SHELL_LANGS = ("sh", "bash", "shell", "console")

FENCE = re.compile(r"^\s*(`{3,}|~{3,})\s*([\w-]*)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
INLINE_CODE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
URL_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
REPO_PATH = re.compile(r"(?<![\w./~$-])((?:%s)/[\w./{},*-]*)((?:::\w+)*)"
                       % "|".join(re.escape(r) for r in REPO_ROOTS))
PACKAGE_PATH = re.compile(r"(?<![\w./~$-])((?:%s)/[\w/]+\.py)" % "|".join(PACKAGE_DIRS))
DOCS_REFERENCE = re.compile(r"docs/([\w-]+\.md)(?:#([\w-]+))?")


@dataclass
class Page:
    """One markdown file split into its prose (code blocks blanked) and its fenced code blocks."""

    path: Path
    prose: list[str]
    blocks: list[tuple[str, list[str]]]

    @classmethod
    def read(cls, path: Path) -> Page:
        prose: list[str] = []
        blocks: list[tuple[str, list[str]]] = []
        fence = ""
        for line in path.read_text(encoding="utf-8").splitlines():
            opening = FENCE.match(line)
            if not fence and opening:
                fence = opening.group(1)
                blocks.append((opening.group(2).lower(), []))
                prose.append("")
            elif fence:
                if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                    fence = ""
                else:
                    blocks[-1][1].append(line)
                prose.append("")
            else:
                prose.append(line)
        assert not fence, f"{path.name}: a code block is never closed"
        return cls(path, prose, blocks)

    @property
    def name(self) -> str:
        return str(self.path.relative_to(REPO))

    def prose_without_code(self) -> list[str]:
        return [INLINE_CODE.sub("", line) for line in self.prose]

    def anchors(self) -> set[str]:
        """The heading anchors GitHub gives this page (lowercased, punctuation dropped, spaces to
        hyphens, repeats numbered)."""
        seen: dict[str, int] = {}
        anchors = set()
        for line in self.prose:
            match = HEADING.match(line)
            if not match:
                continue
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(2)).replace("`", "")
            slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
        return anchors

    def shell_commands(self, blocks: list[tuple[str, list[str]]] | None = None) -> list[list[str]]:
        """Each simple command of the page's shell blocks as tokens: comments cut, continuation
        lines joined, `&&` / `;` / `|` chains split, leading VAR=value assignments dropped."""
        commands = []
        for lang, lines in self.blocks if blocks is None else blocks:
            if lang not in SHELL_LANGS:
                continue
            for line in re.sub(r"\\\n", " ", "\n".join(lines)).splitlines():
                lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
                lexer.whitespace_split = True
                tokens: list[str] = []
                for token in [*lexer, ";"]:
                    if token not in ("&&", "||", ";", "|", "&"):
                        tokens.append(token)
                        continue
                    while tokens and re.match(r"^[A-Za-z_]\w*=", tokens[0]):
                        tokens.pop(0)
                    if tokens:
                        commands.append(tokens)
                    tokens = []
        return commands


PAGE = {page.path: page for page in map(Page.read, PAGES)}


def _makefile() -> tuple[set[str], set[str]]:
    """The Makefile's targets and variables."""
    targets, variables = set(), set()
    for line in (REPO / "Makefile").read_text(encoding="utf-8").splitlines():
        if line.startswith("\t"):
            continue
        variable = re.match(r"^(?:export\s+)?([A-Za-z_]\w*)\s*(?:\?|:|\+)?=", line)
        if variable:
            variables.add(variable.group(1))
            continue
        rule = re.match(r"^([\w.%/ -]+?)\s*:(?!=)", line)
        if rule:
            targets.update(t for t in rule.group(1).split() if not t.startswith("."))
    return targets, variables


def _subcommands() -> dict[str, set[str]]:
    """`vlmcp` sub-command -> the option strings it accepts (argparse's parser tree)."""
    parser = build_parser()
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: {s for action in sub._actions for s in action.option_strings}
            for name, sub in actions[0].choices.items()}


def _vlmcp_call(tokens: list[str]) -> list[str] | None:
    """The arguments after `vlmcp` in `vlmcp ...`, `python -m vlmcp ...` or a launcher's
    `-m vlmcp ...` / `--module vlmcp ...`; None when the command does not run vlmcp's CLI."""
    if tokens[0] == "vlmcp":
        return tokens[1:]
    for i in range(len(tokens) - 1):
        if tokens[i] in ("-m", "--module") and tokens[i + 1] == "vlmcp":
            return tokens[i + 2:]
    return None


def _command_problems(tokens: list[str], targets: set[str], variables: set[str],
                      subcommands: dict[str, set[str]]) -> list[str]:
    """What does not exist in one command line: a make target or variable, a vlmcp sub-command
    or option, a `python -m vlmcp.X` module."""
    shown = " ".join(tokens)
    problems = []
    if tokens[0] == "make":
        for token in tokens[1:]:
            if token.startswith("-"):
                continue
            name = token.split("=", 1)[0]
            if "=" in token and name not in variables:
                problems.append(f"`{shown}`: the Makefile has no variable {name}")
            elif "=" not in token and token not in targets:
                problems.append(f"`{shown}`: the Makefile has no target {token}")
        return problems
    for i in range(len(tokens) - 1):
        if tokens[i] == "-m" and tokens[i + 1].startswith("vlmcp."):
            if importlib.util.find_spec(tokens[i + 1]) is None:
                problems.append(f"`{shown}`: no module {tokens[i + 1]}")
    arguments = _vlmcp_call(tokens)
    if arguments is None:
        return problems
    if not arguments or arguments[0] not in subcommands:
        return problems + [f"`{shown}`: not a vlmcp sub-command ({', '.join(subcommands)})"]
    for token in arguments[1:]:
        option = token.strip("[]").split("=", 1)[0]
        if option.startswith("--") and option not in subcommands[arguments[0]]:
            problems.append(f"`{shown}`: `vlmcp {arguments[0]}` has no option {option}")
    return problems


def _expand_braces(path: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", path)
    if not match:
        return [path]
    return [expanded for choice in match.group(1).split(",")
            for expanded in _expand_braces(path[:match.start()] + choice + path[match.end():])]


def _named_paths(page: Page) -> list[tuple[str, list[str]]]:
    """(path relative to the repository, test node names after `::`) for every repository path in
    the page's inline code and shell blocks."""
    texts = [span for line in page.prose for span in INLINE_CODE.findall(line)]
    texts += [token for tokens in page.shell_commands() for token in tokens]
    named = []
    for text in texts:
        for match in REPO_PATH.finditer(text):
            named.append((match.group(1).rstrip(".,"), match.group(2).split("::")[1:]))
        for match in PACKAGE_PATH.finditer(text):
            named.append((f"vlmcp/{match.group(1)}", []))
    return named


def test_config_doc_key_table_lists_exactly_the_schema_keys_with_their_defaults():
    rows: dict[str, str] = {}
    in_table = False
    for line in PAGE[REPO / "docs" / "config.md"].prose:
        cells = [c.strip() for c in line.strip().split("|")[1:-1]]
        if cells[:2] == ["key", "default"]:
            in_table = True
        elif in_table and not cells:
            in_table = False
        elif in_table and not set(cells[0]) <= set("-: "):
            key = re.fullmatch(r"`([^`]+)`", cells[0])
            assert key, f"docs/config.md: key cell {cells[0]!r} is not a `key`"
            assert key.group(1) not in rows, f"docs/config.md lists {key.group(1)} twice"
            rows[key.group(1)] = cells[1]
    schema = {key: default for key, default, _ in schema_fields()}
    assert rows, "docs/config.md has no | key | default | meaning | table"
    assert sorted(set(schema) - set(rows)) == [], "schema keys missing from docs/config.md"
    assert sorted(set(rows) - set(schema)) == [], "docs/config.md keys the schema does not have"
    for key, default in schema.items():
        shown = "**required**" if default == "" else f"`{json.dumps(default)}`"
        assert rows[key] == shown, f"docs/config.md: {key} default {rows[key]}, schema {shown}"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves_to_a_file_and_its_heading(path):
    page = PAGE[path]
    problems = []
    for number, line in enumerate(page.prose_without_code(), 1):
        for target in LINK.findall(line):
            if URL_SCHEME.match(target):
                continue
            file_part, _, anchor = target.partition("#")
            resolved = (path.parent / file_part).resolve() if file_part else path
            where = f"{page.name}:{number}: ({target})"
            if not resolved.is_relative_to(REPO) or not resolved.exists():
                problems.append(f"{where} no such file")
            elif anchor and resolved.suffix == ".md":
                linked = PAGE.get(resolved) or Page.read(resolved)
                if anchor not in linked.anchors():
                    problems.append(f"{where} no heading #{anchor} in {linked.name}")
    assert problems == []


def test_every_command_in_the_readme_first_block_is_a_make_target_or_vlmcp_command():
    page = PAGE[README]
    assert page.blocks, "README.md has no code block"
    commands = page.shell_commands(page.blocks[:1])
    assert commands, "README.md's first code block holds no shell command"
    targets, variables = _makefile()
    subcommands = _subcommands()
    problems = []
    for tokens in commands:
        if tokens[0] != "make" and _vlmcp_call(tokens) is None:
            problems.append(f"`{' '.join(tokens)}`: neither `make` nor `vlmcp`")
        problems += _command_problems(tokens, targets, variables, subcommands)
    assert problems == []


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_make_and_vlmcp_command_the_docs_show_exists_with_its_options(path):
    targets, variables = _makefile()
    subcommands = _subcommands()
    problems = [problem for tokens in PAGE[path].shell_commands()
                for problem in _command_problems(tokens, targets, variables, subcommands)]
    assert problems == []


def test_readme_command_list_names_every_vlmcp_subcommand():
    page = PAGE[README]
    in_section, listed = False, set()
    for line in page.path.read_text(encoding="utf-8").splitlines():
        heading = HEADING.match(line)
        if heading:
            in_section = heading.group(2) == "Commands"
        elif in_section and line.startswith("vlmcp "):
            listed.add(line.split()[1])
    assert listed == set(_subcommands())


@pytest.mark.parametrize("path", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_repository_path_and_test_name_the_docs_give_exists(path):
    page = PAGE[path]
    problems = []
    for named, test_names in _named_paths(page):
        for candidate in _expand_braces(named):
            matches = list(REPO.glob(candidate)) if "*" in candidate else [REPO / candidate]
            if not any(m.exists() for m in matches):
                problems.append(f"{page.name}: {candidate} does not exist")
                continue
            for test_name in test_names:
                source = matches[0].read_text(encoding="utf-8")
                if not re.search(rf"^\s*(?:def|class)\s+{test_name}\b", source, re.MULTILINE):
                    problems.append(f"{page.name}: {candidate} has no {test_name}")
    assert problems == []


def test_docs_references_in_the_code_and_launch_files_resolve():
    sources = [*sorted((REPO / "vlmcp").rglob("*.py")), *sorted((REPO / "launch").rglob("*")),
               REPO / "Makefile", REPO / "pyproject.toml"]
    problems = []
    for source in (s for s in sources if s.is_file()):
        for name, anchor in DOCS_REFERENCE.findall(source.read_text(encoding="utf-8")):
            target = REPO / "docs" / name
            where = f"{source.relative_to(REPO)}: docs/{name}"
            if not target.exists():
                problems.append(f"{where} does not exist")
            elif anchor and anchor not in PAGE[target].anchors():
                problems.append(f"{where} has no heading #{anchor}")
    assert problems == []


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / target.partition("#")[0]).resolve()
              for line in PAGE[README].prose_without_code() for target in LINK.findall(line)}
    assert [p.name for p in DOCS if p.resolve() not in linked] == []


def test_readme_stays_a_landing_page_of_about_200_lines():
    lines = len(README.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail to docs/"


def _tour_paths() -> set[str]:
    """Module paths the code tour (docs/code-tour.md) lists: its text block, indentation as
    nesting."""
    text = (REPO / "docs" / "code-tour.md").read_text()
    block = text.split("```text\n", 1)[1].split("```", 1)[0]
    paths: set[str] = set()
    parents: list[tuple[int, str]] = []
    for line in block.splitlines():
        name = line.strip().split("  ")[0].split(" ")[0]
        depth = len(line) - len(line.lstrip())
        while parents and parents[-1][0] >= depth:
            parents.pop()
        path = "".join(p for _, p in parents) + name
        if name.endswith("/"):
            parents.append((depth, name))
        paths.add(path)
    return paths


def test_the_code_tour_lists_every_module_of_the_package():
    modules = {str(path.relative_to(REPO)) for path in (REPO / "vlmcp").rglob("*.py")
               if path.name != "__init__.py"}
    assert sorted(modules - _tour_paths()) == []
    assert sorted(p for p in _tour_paths() - modules
                  if p.startswith("vlmcp/") and p.endswith(".py")) == []
