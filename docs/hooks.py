"""MkDocs hooks: the API reference and the command-line reference, generated at build time.

``<!-- api: MODULE -->`` becomes one mkdocstrings block per public name of MODULE (its
``__all__``), each at the module where it is defined; ``<!-- cli -->`` becomes the help of every
``paraloom`` subcommand, taken from the parser itself. Neither can drift from the code.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
from typing import Any

_API = re.compile(r"<!-- api: ([\w.]+) -->")
_rendered: set[str] = set()
"""Objects rendered so far in this build: a name re-exported by several modules is rendered
once (where the navigation first shows it) and linked from the others."""


def _api(module_name: str) -> str:
    module = importlib.import_module(module_name)
    blocks, links = [], []
    for name in module.__all__:
        obj = getattr(module, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue  # constants are described where they are used
        path = f"{obj.__module__}.{obj.__qualname__}"
        if path in _rendered:
            links.append(f"[`{name}`][{path}]")
            continue
        _rendered.add(path)
        blocks.append(f"::: {path}")
    if links:
        blocks.append("Also here, described on another page: " + ", ".join(links) + ".")
    return "\n\n".join(blocks)


def on_pre_build(config: Any) -> None:
    _rendered.clear()


def _subcommands(parser: argparse.ArgumentParser, prefix: str) -> list[tuple[str, str]]:
    found = [(prefix, parser.format_help())]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += _subcommands(sub, f"{prefix} {name}")
    return found


def _cli() -> str:
    from paraloom.cli import _parser

    out = []
    for command, text in _subcommands(_parser(), "paraloom"):
        out.append(f"## `{command}`\n\n```text\n{text.rstrip()}\n```")
    return "\n\n".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    markdown = _API.sub(lambda m: _api(m.group(1)), markdown)
    if "<!-- cli -->" in markdown:
        markdown = markdown.replace("<!-- cli -->", _cli())
    return markdown
