"""EngineConfig's fields as the service's flags, KVBOOST_* variables and docs/configuration.md rows, generated from
their declarations (inference_service/config.py); `python -m inference_service.serving.engine_flags` rewrites the
doc's generated block."""
from __future__ import annotations

import argparse
import sys
from dataclasses import Field, fields
from pathlib import Path
from typing import Any, Callable

from inference_service.config import AUTO, FROM_WEIGHTS, SAME, EngineConfig, FieldError, knob_of

SWITCH_WORDS = {"auto": None, "on": True, "off": False}
DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
BEGIN = ("<!-- engine flags: generated from inference_service/config.py by "
         "`python -m inference_service.serving.engine_flags`; edit the fields, not these rows -->")
END = "<!-- end of the engine flags -->"
DOC_HEADER = ("| flag | env | default | meaning |", "|---|---|---|---|")


def flag_fields(cls: type = EngineConfig) -> list[Field]:
    """The fields that are flags, in declaration order (a field declared with flag=None is not one)."""
    return [item for item in fields(cls) if knob_of(item).flag is not None]


def flag_of(item: Field) -> str:
    return "--" + (knob_of(item).flag or item.name.replace("_", "-"))


def env_of(item: Field) -> str:
    """KVBOOST_ and the flag's name: --fidelity-guard reads KVBOOST_FIDELITY_GUARD."""
    return "KVBOOST_" + flag_of(item)[2:].upper().replace("-", "_")


def service_default(item: Field) -> Any:
    declared = knob_of(item).service_default
    return item.default if declared is SAME else declared


def is_switch(item: Field) -> bool:
    return knob_of(item).resolved == AUTO and "bool" in str(item.type)


def is_auto_bytes(item: Field) -> bool:
    return knob_of(item).resolved == AUTO and "int" in str(item.type)


def bytes_or_auto(text: str) -> int | None:
    """A byte count, or None for 'auto' (sized from the machine at start)."""
    if text.strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number of bytes nor auto") from None


def switch(text: str) -> bool | None:
    """auto, on or off -> None, True, False."""
    try:
        return SWITCH_WORDS[text.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"{text!r} is not one of auto, on, off") from None


def shown(item: Field, value: Any) -> str:
    """A default as a user writes it: auto, on/off, or the value."""
    if is_switch(item) or (is_auto_bytes(item) and value is None):
        return "auto" if value is None else ("on" if value else "off")
    return str(value)


def add_engine_flags(parser: argparse.ArgumentParser, default: Callable[..., Any], cls: type = EngineConfig) -> None:
    """One flag per field, its default read from the field's KVBOOST_ variable (`default`: env_default_reader)."""
    group = parser.add_argument_group("engine", "the engine's configuration (inference_service/config.py)")
    for item in flag_fields(cls):
        declared = knob_of(item)
        name = env_of(item).removeprefix("KVBOOST_")
        value = service_default(item)
        text = declared.help.replace("%", "%%") + f" ({env_of(item)})"
        options: dict[str, Any] = {"dest": item.name, "help": text}
        if isinstance(value, bool) and not is_switch(item):
            options.update(action=argparse.BooleanOptionalAction, default=default(name, value))
        elif is_switch(item) or is_auto_bytes(item):
            kind = switch if is_switch(item) else bytes_or_auto
            options.update(type=kind, default=default(name, shown(item, value), str),
                           metavar="{auto,on,off}" if is_switch(item) else "BYTES|auto")
        elif declared.resolved == FROM_WEIGHTS:
            options.update(type=float, default=default(name, value, float))
        else:
            options.update(type=type(value), default=default(name, value), metavar=name)
        if declared.choices:  # retired names (accepted) still parse; --help lists the current ones
            options.update(choices=declared.choices + declared.accepted,
                           metavar="{" + ",".join(map(str, declared.choices)) + "}")
        group.add_argument(flag_of(item), **options)


def engine_config_from_args(args: argparse.Namespace, cls: type = EngineConfig) -> Any:
    """Takes the engine's fields out of `args` (parsed with add_engine_flags) and builds the config; a value a
    field's check refuses raises ValueError naming the flag ("--l0-bytes must be ...")."""
    values = {item.name: vars(args).pop(item.name) for item in flag_fields(cls)}
    try:
        return cls(**values)
    except FieldError as error:
        item = next(item for item in fields(cls) if item.name == error.name)
        raise ValueError(FieldError.said(flag_of(item), error.need, error.value)) from None


def doc_rows(cls: type = EngineConfig) -> list[str]:
    """The doc's table of the engine's flags: flag, variable, the service's default, meaning."""
    rows = list(DOC_HEADER)
    for item in flag_fields(cls):
        declared = knob_of(item)
        value = service_default(item)
        names = f"`{flag_of(item)}`"
        if isinstance(value, bool) and not is_switch(item):
            names += f" / `--no-{flag_of(item)[2:]}`"
        meaning = declared.help
        if declared.service_default is not SAME:
            meaning += f". An `EngineConfig` built in code defaults to `{shown(item, item.default)}`: {declared.why}"
        rows.append(f"| {names} | `{env_of(item)}` | {_doc_default(item, value)} | {meaning.replace('|', chr(92) + '|')} |")
    return rows


def _doc_default(item: Field, value: Any) -> str:
    declared = knob_of(item)
    if declared.shown_default:
        return declared.shown_default
    if isinstance(value, bool) and not is_switch(item):
        return "on" if value else "off"
    if value == "":
        return "–"
    return f"`{shown(item, value)}`"


def doc_block(cls: type = EngineConfig) -> str:
    return "\n".join([BEGIN, "", *doc_rows(cls), "", END])


def generated_block(text: str) -> str:
    """The doc's block between BEGIN and END, markers included; '' when it has none."""
    if BEGIN not in text or END not in text:
        return ""
    return text[text.index(BEGIN):text.index(END) + len(END)]


def main(argv: list[str] | None = None) -> int:
    """Rewrites the generated block of docs/configuration.md (or the file named) from the fields."""
    path = Path(argv[0]) if argv else DOC
    text = path.read_text()
    block = generated_block(text)
    if not block:
        sys.exit(f"{path}: no generated block (a line {BEGIN!r} ... {END!r})")
    path.write_text(text.replace(block, doc_block()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
