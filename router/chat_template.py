"""A tokenizer's chat template rendered with jinja2 alone, in the environment transformers renders it in.

The service renders chat messages with transformers' apply_chat_template; the router must produce the same text
(so the same token ids and chunk keys) without importing transformers. What a template sees there, and so here: a
sandbox that refuses to mutate what it is given, trim_blocks and lstrip_blocks, the loop controls (break,
continue), a `{% generation %}` block that renders its body as is, a `tojson` filter that leaves non-ASCII and
HTML characters alone, `raise_exception(message)` and `strftime_now(format)`; `messages`, `tools` and `documents`
(None here), `add_generation_prompt`, and every named special token (`bos_token`, `eos_token`, ...). A test renders
chats through both and compares the ids (tests/router/test_tokenizer.py).
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Mapping, Sequence

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks; rendering keeps it."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller) -> str:
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML; a prompt wants the characters themselves.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace() without underscore names, so a template cannot reach an object's internals through it."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_public(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _check_public(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_public(name) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a chat template cannot set {name!r} on a namespace")


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    """Raises jinja2.TemplateSyntaxError for a template that does not parse."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[_GenerationBlock, loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["namespace"] = _Namespace
    return environment.from_string(source)


def render_chat(source: str, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool,
                special_tokens: Mapping[str, str]) -> str:
    """The conversation as the template writes it. Raises ValueError for no messages, jinja2.TemplateError for a
    template that refuses them."""
    if not messages:
        raise ValueError("Cannot apply a chat template to an empty conversation")
    # Keys whose value is None are dropped, as transformers drops them (templates test for a key, not for None).
    conversation = [{key: value for key, value in message.items() if value is not None} for message in messages]
    return compile_template(source).render(messages=conversation, tools=None, documents=None,
                                           add_generation_prompt=add_generation_prompt, **special_tokens)
