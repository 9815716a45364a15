"""docs/configuration.md against the real argument parsers: every flag a process takes is in that process's
section, no section lists a flag its process does not take (a misplaced, removed or misspelt one), and each row
names the environment variable the flag's own help names."""
from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

from cache_daemon.config import build_parser as cache_daemon_parser
from http_gateway.config import build_parser as gateway_parser
from inference_service.serving.config import build_parser as service_parser
from router.config import build_parser as router_parser

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
# The section heading (its `python -m ...` command) -> the parser of that process, built at test time so flags
# added or removed in code are checked as they are now.
PARSERS = {
    "python -m cache_daemon": cache_daemon_parser,
    "python -m inference_service": service_parser,
    "python -m http_gateway": gateway_parser,
    "python -m router": router_parser,
}


def gateway_mark() -> str:
    """kvboost_server's GATEWAY_MARK, read from its source: importing that module loads the whole engine."""
    tree = ast.parse((ROOT / "kvboost_server" / "__main__.py").read_text())
    return next(node.value.value for node in tree.body if isinstance(node, ast.Assign)
                and [getattr(target, "id", None) for target in node.targets] == ["GATEWAY_MARK"])


FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")
ENV = re.compile(r"KVBOOST_[A-Z0-9_]+")


def sections(text: str) -> dict[str, list[str]]:
    """'## ' heading -> the lines under it."""
    found: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
            found[current] = []
        elif current is not None:
            found[current].append(line)
    return found


def section_of(text: str, command: str) -> list[str]:
    matches = [lines for heading, lines in sections(text).items() if f"`{command}`" in heading]
    assert len(matches) == 1, f"docs/configuration.md needs exactly one '## ...(`{command}`...)' section"
    return matches[0]


def table_flags(lines: list[str]) -> set[str]:
    """The flags named in the first cell of every table row of a section."""
    flags = set()
    for line in lines:
        if line.startswith("|") and not is_separator(line):
            flags.update(FLAG.findall(line.split("|")[1]))
    return flags


def env_cells(lines: list[str]) -> dict[str, str]:
    """flag -> the env cell of its row (a row may name several flags: `--tls-cert` / `--tls-key`)."""
    cells = {}
    for line in lines:
        if line.startswith("|") and not is_separator(line):
            columns = line.split("|")
            for flag in FLAG.findall(columns[1]):
                cells[flag] = columns[2] if len(columns) > 2 else ""
    return cells


def wrong_env_names(lines: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """'--flag: KVBOOST_X' for every documented flag whose row does not name the variable its help ends with
    (every parser's help names its variable last: "... (KVBOOST_MODEL)")."""
    cells = env_cells(lines)
    wrong = []
    for action in parser._actions:
        names = [name for name in action.option_strings if name in cells]
        named = ENV.findall(action.help or "")
        if names and named and action.help != argparse.SUPPRESS and named[-1] not in cells[names[0]]:
            wrong.append(f"{names[0]}: {named[-1]}")
    return wrong


def parser_flags(parser: argparse.ArgumentParser) -> list[tuple[str, ...]]:
    """Each documented argument's long option strings (help=SUPPRESS marks a removed flag kept only to explain
    itself); '--no-x' of a boolean flag comes with '--x'."""
    return [tuple(option for option in action.option_strings if option.startswith("--"))
            for action in parser._actions
            if action.option_strings and action.help != argparse.SUPPRESS and "--help" not in action.option_strings]


def missing_and_misplaced(lines: list[str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    documented = table_flags(lines)
    options = parser_flags(parser)
    missing = sorted(names[0] for names in options if not documented & set(names))
    known = {name for names in options for name in names}
    misplaced = sorted(documented - known)
    return missing, misplaced


def is_separator(line: str) -> bool:
    return line.startswith("|") and "-" in line and set(line.strip()) <= set("|-: ")


def split_tables(lines: list[str]) -> list[str]:
    """Table rows that follow a line that is not a table row: Markdown ends a table at any other line, so such a
    row renders as text (a header row followed by its separator starts a new table and is fine)."""
    split = []
    for before, line, after in zip([""] + lines, lines, lines[1:] + [""]):
        if line.startswith("|") and not before.startswith("|") and not is_separator(after):
            split.append(line[:80])
    return split


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_each_process_section_lists_exactly_its_flags(command):
    missing, misplaced = missing_and_misplaced(section_of(DOC.read_text(), command), PARSERS[command]({}))
    assert not missing, f"flags of `{command}` missing from its section of docs/configuration.md: {missing}"
    assert not misplaced, f"docs/configuration.md lists under `{command}` flags it does not take: {misplaced}"


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_each_row_names_the_environment_variable_its_flag_reads(command):
    wrong = wrong_env_names(section_of(DOC.read_text(), command), PARSERS[command]({}))
    assert not wrong, f"rows of `{command}` in docs/configuration.md that miss the flag's variable: {wrong}"


def test_the_one_process_server_section_says_how_flags_split():
    lines = section_of(DOC.read_text(), "python -m kvboost_server")
    mark = gateway_mark()
    assert any(f"`{mark}`" in line for line in lines), \
        f"the kvboost_server section must say that flags after `{mark}` are the gateway's"


def test_no_table_is_split_by_a_paragraph():
    assert not split_tables(DOC.read_text().splitlines()), "a table row after a paragraph renders as text"


def test_the_check_fails_on_a_missing_and_a_misplaced_flag():
    parser = argparse.ArgumentParser()
    parser.add_argument("--listen", help="where (KVBOOST_LISTEN)")
    parser.add_argument("--keys", action=argparse.BooleanOptionalAction, help="keys (KVBOOST_KEYS)")
    parser.add_argument("--old", help=argparse.SUPPRESS)
    doc = ["| flag | env |", "|---|---|", "| `--no-keys` | X |", "| `--store-deadline` | Y |"]
    assert missing_and_misplaced(doc, parser) == (["--listen"], ["--store-deadline"])
    assert wrong_env_names(doc + ["| `--listen` | `KVBOOST_LISTEN` |"], parser) == ["--no-keys: KVBOOST_KEYS"]
    assert split_tables(["| a |", "|---|", "| `--x` |", "", "text", "| `--y` | 1 |"]) == ["| `--y` | 1 |"]
