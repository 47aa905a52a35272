"""cli.app_for: a run that names a command gets an app holding that command alone (typer builds every command's
parameters on each run), and that command is the one the whole app would have run: the same parameters, help and
usage. Anything else (no command, the root's options, a mistyped name) gets the whole app."""

from __future__ import annotations

import pytest
import typer
import typer.main

import cli

_FULL = typer.main.get_command(cli.app)
NAMES = sorted(_FULL.commands)  # type: ignore[attr-defined]  # a group (the app has a callback)


def _info(group, name: str) -> dict:
    cmd = group.commands[name]
    with typer.Context(group, info_name="ggfit") as root, typer.Context(cmd, info_name=name, parent=root) as ctx:
        params = [(p.name, p.opts, p.secondary_opts, p.required, repr(p.default), p.nargs, p.multiple, p.type.name)
                  for p in cmd.params]
        return {"params": params, "help": cmd.get_help(ctx), "usage": cmd.get_usage(ctx)}


@pytest.mark.parametrize("name", NAMES)
def test_the_app_for_a_command_holds_it_alone_as_the_whole_app_builds_it(name):
    one = typer.main.get_command(cli.app_for([name, "--help"]))
    assert list(one.commands) == [name]  # type: ignore[attr-defined]
    assert _info(one, name) == _info(_FULL, name)


@pytest.mark.parametrize("args", [[], ["--help"], ["fti", "x"], ["FIT"], ["--", "fit"]], ids=repr)
def test_anything_but_a_command_name_first_gets_the_whole_app(args):
    assert cli.app_for(args) is cli.app


def test_every_command_is_reachable():
    assert len(NAMES) == len(cli.app.registered_commands) == 10
    for name in NAMES:
        assert cli.app_for([name]) is not cli.app
