"""Every flag of every `orchestrator` command says what it does in --help."""

import argparse

from orchestrator.cli import build_parser


def parsers(parser: argparse.ArgumentParser, path: str = "orchestrator"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{path} {name}")


def test_every_flag_of_every_command_has_help_text():
    missing = [f"{path} {action.option_strings[-1]}" for path, parser in parsers(build_parser())
               for action in parser._actions
               if action.option_strings and not isinstance(action, argparse._HelpAction) and not action.help]
    assert missing == []
