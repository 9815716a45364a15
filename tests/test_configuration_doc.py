"""docs/configuration.md against the real argument parsers: every flag a process takes is in that process's
section, no section lists a flag its process does not take (a misplaced, removed or misspelt one), and each row
names the environment variable the flag's own help names. The engine's flags, variables and rows are generated from
EngineConfig's fields: a field added there is all three, with no other edit."""
from __future__ import annotations

import argparse
import ast
import re
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

from cache_daemon.config import build_parser as cache_daemon_parser
from http_gateway.config import build_parser as gateway_parser
from inference_service.config import AUTO, SAME, EngineConfig, FieldError, knob, knob_of
from inference_service.serving.config import build_parser as service_parser
from inference_service.serving.engine_flags import (add_engine_flags, doc_block, doc_rows, engine_config_from_args,
                                                    generated_block)
from kvboost_common.env_defaults import env_default_reader
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


# ---- the engine's configuration, declared once ---------------------------------------------------------------

@dataclass(slots=True, frozen=True)
class WiderEngineConfig(EngineConfig):
    """EngineConfig with three fields more, declared as any field is: nothing else is edited for them."""

    prefill_budget_ms: int = knob(250, "milliseconds of prefill per step", lambda value: value > 0, "positive")
    spill_bytes: int | None = knob(0, "bytes spilled to disk; auto: by the disk", lambda value: value is None or value >= 0,
                                   ">= 0 or auto", resolved=AUTO, service_default=None, why="tests spill nothing")
    probe_layers: int = knob(2, "layers probed", lambda value: value >= 0, ">= 0", flag=None, why="measured in code")


def wider_parser(environ: dict[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_flags(parser, env_default_reader(environ), WiderEngineConfig)
    return parser


def test_a_new_field_becomes_a_flag_a_variable_and_a_doc_row():
    parser = wider_parser({"KVBOOST_PREFILL_BUDGET_MS": "300"})
    # The flag, its variable (KVBOOST_ and the flag's name) and the library's default under the service's.
    assert engine_config_from_args(parser.parse_args([]), WiderEngineConfig).prefill_budget_ms == 300
    config = engine_config_from_args(parser.parse_args(["--prefill-budget-ms", "7", "--chunk-size", "16"]),
                                     WiderEngineConfig)
    assert (config.prefill_budget_ms, config.chunk_size, config.spill_bytes, config.probe_layers) == (7, 16, None, 2)
    assert engine_config_from_args(wider_parser({}).parse_args(["--spill-bytes", "4096"]),
                                   WiderEngineConfig).spill_bytes == 4096
    assert WiderEngineConfig().spill_bytes == 0  # the library's default; the flag's is auto, declared in the field
    # Its check, once, said with the flag's name on the command line and the field's in code.
    with pytest.raises(ValueError, match="^--prefill-budget-ms must be positive, got 0$"):
        engine_config_from_args(wider_parser({}).parse_args(["--prefill-budget-ms", "0"]), WiderEngineConfig)
    with pytest.raises(FieldError, match="^prefill_budget_ms must be positive, got -1$"):
        WiderEngineConfig(prefill_budget_ms=-1)
    # Its doc row: the checks this file runs on docs/configuration.md pass on the generated rows alone.
    rows = doc_rows(WiderEngineConfig)
    assert missing_and_misplaced(rows, parser) == ([], [])
    assert wrong_env_names(rows, parser) == []
    assert "| `--prefill-budget-ms` | `KVBOOST_PREFILL_BUDGET_MS` | `250` | milliseconds of prefill per step |" in rows
    spill = next(row for row in rows if "`--spill-bytes`" in row)
    assert "| `auto` |" in spill and "built in code defaults to `0`: tests spill nothing" in spill
    assert "--probe-layers" not in "\n".join(rows) and "--probe-layers" not in parser.format_help()
    # And the doc as it stands lacks exactly the new flags: the checks above would fail it.
    documented = section_of(DOC.read_text(), "python -m inference_service")
    assert missing_and_misplaced(documented, parser)[0] == ["--prefill-budget-ms", "--spill-bytes"]


def test_the_doc_holds_the_rows_generated_from_the_engine_fields():
    block = generated_block(DOC.read_text())
    assert block, "docs/configuration.md lost its generated block of the engine's flags"
    assert block == doc_block(), ("docs/configuration.md's engine rows differ from EngineConfig's fields: run "
                                  "`python -m inference_service.serving.engine_flags`")


def test_every_engine_field_without_a_flag_or_with_another_default_says_why():
    for item in fields(EngineConfig):
        declared = knob_of(item)
        if declared.flag is None or declared.service_default is not SAME:
            assert declared.why, f"EngineConfig.{item.name}: say why it has no flag or another default"


def test_the_service_takes_each_engine_flag_from_the_declaration():
    service = service_parser({})
    for item in fields(EngineConfig):
        takes = [action for action in service._actions if action.dest == item.name]
        assert len(takes) == (knob_of(item).flag is not None), item.name


def test_engine_fields_are_checked_with_value_errors_that_say_what_to_pass():
    with pytest.raises(FieldError, match="^chunk_size must be positive, got 0$"):
        EngineConfig(chunk_size=0)
    with pytest.raises(ValueError, match="^l0_bytes must be >= 0 \\(0 = off\\) or auto, got -1$"):
        EngineConfig(l0_bytes=-1)
    with pytest.raises(ValueError, match="recompute_when_faster must be auto, on or off, got sometimes"):
        EngineConfig(recompute_when_faster="sometimes")
