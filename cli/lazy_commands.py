"""Commands named in a table and imported only when looked up, so ``ckptrun --help`` stays fast.

Importing every command module up front cost ~0.4 s per invocation (pydantic, the record readers,
the RTO model) before anything was printed. A :class:`LazyCommand` names the module and the function
and carries the one-line summary the top-level help lists; the module is imported, and the click
command built as ``app.command()`` would have built it, only when click looks the command up:
on dispatch, ``ckptrun CMD --help`` and shell completion. Every command shows the group's epilog.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any, ClassVar

import typer.main
from typer._click import Command, Context, HelpFormatter
from typer._click.utils import make_default_short_help
from typer.core import TyperGroup
from typer.models import CommandInfo


@dataclass(frozen=True)
class LazyCommand:
    module: str
    function: str
    summary: str  # the first paragraph of the function's docstring (tests/test_lazy_cli.py keeps them equal)
    context: str | None = None  # "module:NAME" of a context-settings dict (click's parsing of SCRIPT ARGS)
    metavar: str = "[OPTIONS]"  # options_metavar, where the default does not describe the arguments


class LazyCommands(MutableMapping[str, Command]):
    """``group.commands``: a name's click command is built on first access, then kept."""

    def __init__(self, table: dict[str, LazyCommand], built: dict[str, Command], epilog: str | None) -> None:
        self.table, self.built, self.epilog = table, dict(built), epilog

    def __getitem__(self, name: str) -> Command:
        if name not in self.built:
            self.built[name] = self.build(name, self.table[name])  # KeyError for an unknown name, as a dict
        return self.built[name]

    def __setitem__(self, name: str, command: Command) -> None:
        self.built[name] = command

    def __delitem__(self, name: str) -> None:
        if name not in self:
            raise KeyError(name)
        self.table.pop(name, None)
        self.built.pop(name, None)

    def __contains__(self, name: object) -> bool:
        return name in self.table or name in self.built  # Mapping's own would build the command

    def __iter__(self) -> Iterator[str]:
        yield from self.table
        yield from (name for name in self.built if name not in self.table)

    def __len__(self) -> int:
        return len(set(self.table) | set(self.built))

    def summary(self, name: str, limit: int) -> str:
        """The help row for ``name`` without importing its module."""
        if name in self.built:
            return self.built[name].get_short_help_str(limit)
        return make_default_short_help(self.table[name].summary, limit)

    def build(self, name: str, entry: LazyCommand) -> Command:
        info = CommandInfo(
            name=name,
            callback=self.attribute(f"{entry.module}:{entry.function}"),
            epilog=self.epilog,
            context_settings=self.attribute(entry.context) if entry.context else None,
            options_metavar=entry.metavar,
        )
        return typer.main.get_command_from_info(info, pretty_exceptions_short=True, rich_markup_mode=None)

    @staticmethod
    def attribute(reference: str) -> Any:
        module, name = reference.split(":")
        return getattr(importlib.import_module(module), name)


class LazyGroup(TyperGroup):
    """A typer group whose commands come from ``table`` (set by a subclass) and load on demand."""

    table: ClassVar[dict[str, LazyCommand]] = {}

    def __init__(self, *, commands: Any = None, **attrs: Any) -> None:
        super().__init__(**attrs)
        self.commands = LazyCommands(dict(self.table), dict(commands or {}), self.epilog)

    def list_commands(self, ctx: Context) -> list[str]:
        return list(self.commands)  # typer's own walks items(), which would import every module

    def format_commands(self, ctx: Context, formatter: HelpFormatter) -> None:
        names = [name for name in self.list_commands(ctx) if not self.hidden_command(name)]
        if not names:
            return
        limit = formatter.width - 6 - max(map(len, names))  # click's own spacing rule
        with formatter.section("Commands"):
            formatter.write_dl([(name, self.commands.summary(name, limit)) for name in names])

    def hidden_command(self, name: str) -> bool:
        built = self.commands.built.get(name)
        return bool(built is not None and built.hidden)
