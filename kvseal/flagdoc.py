"""``docs/flags.md``, written from the command-line parsers themselves, so the reference cannot drift from the
code: ``python -m kvseal.flagdoc > docs/flags.md`` (a test fails when the file is not current)."""

from __future__ import annotations

import argparse

from kvseal.cli import parser


def _commands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _default(a: argparse.Action) -> str:
    if isinstance(a, argparse._StoreTrueAction) or a.default in (None, [], argparse.SUPPRESS):
        return ""
    return f"`{a.default}`"


def render() -> str:
    p = parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    helps = {c.dest: c.help for c in sub._get_subactions()}
    intro = ("Generated from the parsers (`python -m kvseal.flagdoc > docs/flags.md`); `tests/test_flags.py` fails "
             "when this file is not current. Flags that switch a protection off (`--unsafe-no-…`) are left out on "
             "purpose: they exist for tests and need `KVSEAL_UNSAFE=1`.")
    out = ["# Command-line flags", "", intro, ""]
    for name, sp in _commands(p).items():
        out += [f"## `kvseal {name}`", "", helps.get(name) or "", "", "| flag | default | what |", "|---|---|---|"]
        for a in sp._actions:
            if not a.option_strings or a.help == argparse.SUPPRESS or isinstance(a, argparse._HelpAction):
                continue
            flags = ", ".join(f"`{f}`" for f in a.option_strings)
            if a.choices:
                flags += " " + "\\|".join(str(c) for c in a.choices)
            elif a.metavar:
                flags += f" {a.metavar.replace('|', chr(92) + '|')}"
            text = (a.help or "").replace("|", "\\|").replace("\n", " ")
            out.append(f"| {flags} | {_default(a)} | {text} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
