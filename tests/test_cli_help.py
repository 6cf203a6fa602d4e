"""Every flag of every `sustain` command says what it does and what it is when not given.

The test walks the parsers rather than listing them, so a flag added later is held to the same
rule: a help text for every positional and option, and for every option (and optional
positional) a statement of its default: "(default: X)", "off by default", or "default: from the
configuration, <section>.<key>" naming a key that exists.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator

from agent.cli.main import build_parser
from agent.config.settings import Settings

SETTING = re.compile(r"default: from the configuration, ([a-z_]+)\.([a-z_]+)")


def commands(
    parser: argparse.ArgumentParser, prog: str = "sustain"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, f"{prog} {name}")


def problems(parser: argparse.ArgumentParser) -> list[str]:
    """What one parser's help lacks, one line per flag at fault."""
    found: list[str] = []
    formatter = parser._get_formatter()
    for action in parser._actions:
        name = "/".join(action.option_strings) or action.dest
        if isinstance(action, argparse._HelpAction | argparse._VersionAction):
            continue
        if isinstance(action, argparse._SubParsersAction):
            described = {choice.dest for choice in action._choices_actions if choice.help}
            found += [f"{name} {sub}: no help" for sub in action.choices if sub not in described]
            continue
        if not action.help or action.help == argparse.SUPPRESS:
            found.append(f"{name}: no help")
            continue
        text = formatter._expand_help(action)
        required = not action.option_strings and action.nargs in (None, "+")
        if not required and not re.search(r"\bdefault\b", text):
            found.append(f"{name}: no default stated in {text!r}")
        if re.search(r"default:? None\b", text):
            found.append(f"{name}: the default shows as None in {text!r}")
        for section, key in SETTING.findall(text):
            model = Settings.model_fields.get(section)
            fields = model.annotation.model_fields if model and model.annotation else {}
            if key not in fields:
                found.append(f"{name}: no configuration key {section}.{key}")
    return found


def test_every_flag_has_a_help_with_its_default() -> None:
    found = []
    for prog, parser in commands(build_parser()):
        parser.format_help()  # a stray % in a help text would raise here
        found += [f"{prog} {problem}" for problem in problems(parser)]
    assert not found, "\n".join(found)


def test_the_check_catches_a_flag_without_help_or_default() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bare")
    parser.add_argument("--silent", help="says what but not when absent")
    parser.add_argument("--flag", action="store_true", help="on or off")
    parser.add_argument("--unset", help="unset (default: %(default)s)")
    parser.add_argument("--key", help="default: from the configuration, probing.nonexistent")
    parser.add_argument("--fine", default=3, help="fine (default: %(default)s)")
    parser.add_argument("--switch", action="store_true", help="a switch, off by default")
    assert problems(parser) == [
        "--bare: no help",
        "--silent: no default stated in 'says what but not when absent'",
        "--flag: no default stated in 'on or off'",
        "--unset: the default shows as None in 'unset (default: None)'",
        "--key: no configuration key probing.nonexistent",
    ]
