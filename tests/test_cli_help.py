"""Every ``rallypoint`` subcommand has a description and every option and positional
argument a help string: the parser is walked (argparse introspection), so a flag added
without ``help=`` fails here. Also the conventions every subcommand shares: ``--log-level``
after the subcommand, ``--timeout`` a positive number of seconds."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from rallypoint._cli_parser import _build_parser

#: Subcommands the walk must find (a subcommand dropped from the walk would hide its flags).
COMMANDS = {"lighthouse", "run", "status", "goodput", "kill", "inject"}


def commands(parser: argparse.ArgumentParser, path: str = "rallypoint") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(``rallypoint sub``, its parser) for the parser and, depth first, every subparser."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, f"{path} {name}")


def arguments(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    """The parser's own options and positionals (not its subcommand choice, nor -h)."""
    for action in parser._actions:
        if isinstance(action, (argparse._SubParsersAction, argparse._HelpAction)):
            continue
        yield action


def test_walk_finds_every_subcommand():
    assert {path.split()[1] for path, _ in commands(_build_parser()) if " " in path} == COMMANDS


@pytest.mark.parametrize("path", sorted(p for p, _ in commands(_build_parser())))
def test_every_command_has_a_description(path):
    parser = dict(commands(_build_parser()))[path]
    assert parser.description and len(parser.description.split()) >= 5, f"`{path} --help` has no description"


def test_every_option_has_help():
    missing = [f"{path} {'/'.join(a.option_strings) or a.dest}"
               for path, parser in commands(_build_parser()) for a in arguments(parser)
               if not a.help or a.help == argparse.SUPPRESS or not a.help.strip()]
    assert missing == [], f"arguments without help text: {missing}"


def test_subcommands_are_listed_with_help():
    """``rallypoint --help`` shows one line per subcommand."""
    for action in _build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {c.dest: c.help for c in action._choices_actions}
            assert set(helps) == COMMANDS and all(helps.values()), helps


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_log_level_after_the_subcommand(command):
    parser = _build_parser()
    tail = {"lighthouse": ["--min-replicas", "1"], "run": ["train.py"], "kill": ["r1"], "inject": ["slow"]}
    args = parser.parse_args([command, "--log-level", "DEBUG", *tail.get(command, [])])
    assert args.log_level == "DEBUG"
    args = parser.parse_args(["--log-level", "WARNING", command, *tail.get(command, [])])
    assert args.log_level == "WARNING"  # before the subcommand it still counts (the subcommand's default does not clobber it)


def test_run_script_args_keep_their_own_log_level():
    """After the script, ``--log-level`` is the script's argument, not rallypoint's."""
    args = _build_parser().parse_args(["run", "--log-level", "ERROR", "train.py", "--log-level", "X"])
    assert args.log_level == "ERROR" and args.script_args == ["--log-level", "X"]


@pytest.mark.parametrize("command", ["status", "goodput", "kill", "inject"])
def test_client_commands_share_timeout_and_replica_spelling(command, capsys):
    parser = dict(commands(_build_parser()))[f"rallypoint {command}"]
    options = {s for a in arguments(parser) for s in a.option_strings}
    assert {"--timeout", "--lighthouse", "--job", "--log-level"} <= options
    if command in ("kill", "inject"):  # the commands that name a replica name it the same way
        assert "--replica" in options
    timeout = next(a for a in arguments(parser) if "--timeout" in a.option_strings)
    assert "connecting" in (timeout.help or "")
    for bad in ("0", "-1", "soon"):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["--timeout", bad, *(["slow"] if command == "inject" else [])])
        assert e.value.code == 2
    assert "--timeout" in capsys.readouterr().err
