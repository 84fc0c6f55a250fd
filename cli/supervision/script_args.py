"""What ``ckptrun resume -- ARGS`` means for the script's stored arguments: override by name, keep the rest.

``resume --allow-change lr -- --lr 1e-3`` used to replace every stored argument, so ``--epochs 40`` fell
back to the script's default and the run "completed" at once. Now each option in ARGS (``--name VALUE...``,
``--name=VALUE`` or a bare ``--flag``) replaces the stored option of the same name, in place; options not
stored are appended; positional words in ARGS replace the stored positional words. ``--replace-args``
keeps the old behaviour (ARGS are the whole list). Pure functions; importable without torch.
"""

from __future__ import annotations

import re
import shlex

_NUMBER = re.compile(r"^-\d|^-\.\d")  # -1e-3, -.5: a value, not an option


def _is_option(word: str) -> bool:
    return word.startswith("-") and word != "-" and not _NUMBER.match(word)


def _name(option: str) -> str:
    return option.split("=", 1)[0]


def groups(words: list[str]) -> tuple[list[str], list[list[str]]]:
    """(positional words before the first option, option groups: an option and the values that follow it)."""
    positional: list[str] = []
    found: list[list[str]] = []
    for word in words:
        if _is_option(word):
            found.append([word])
        elif found and "=" not in found[-1][0]:
            found[-1].append(word)
        else:
            positional.append(word)
    return positional, found


def merge(stored: list[str], new: list[str]) -> list[str]:
    """The stored arguments with each option of ``new`` overriding the stored one of the same name."""
    old_positional, old_groups = groups(stored)
    new_positional, new_groups = groups(new)
    replacing = {_name(group[0]): group for group in new_groups}
    merged: list[list[str]] = []
    placed: set[str] = set()
    for group in old_groups:
        name = _name(group[0])
        if name in replacing:
            if name not in placed:
                merged.append(replacing[name])
                placed.add(name)
            continue
        merged.append(group)
    merged.extend(group for group in new_groups if _name(group[0]) not in placed)
    return [*(new_positional or old_positional), *(word for group in merged for word in group)]


def command_line(script: str | None, args: list[str]) -> str:
    """The effective command line, as a shell would take it (no script: the embedded default job)."""
    return shlex.join([script, *args]) if script else " ".join(["the default job", *map(shlex.quote, args)])
