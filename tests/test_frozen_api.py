"""The public surface, frozen: CLI commands and options, CKPTRUN_* names, runtime.__all__, manifest schema.

Changing any of them must be a deliberate diff of tests/fixtures/frozen_api.json:
run ``python tests/test_frozen_api.py --update`` and commit the result.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FROZEN = Path(__file__).parent / "fixtures" / "frozen_api.json"


def current_api() -> dict:
    import typer.main

    import ckptrun.runtime as runtime
    from ckptrun.cli.main import app
    from ckptrun.runtime.env import known_variables
    from ckptrun.runtime.manifest import FileEntry, Manifest

    group = typer.main.get_command(app)
    commands = {}
    for name, command in sorted(group.commands.items()):
        commands[name] = sorted(opt for param in command.params for opt in getattr(param, "opts", []) if opt.startswith("-"))
    return {
        "commands": commands,
        "env": sorted(known_variables()),
        "runtime_all": sorted(runtime.__all__),
        "manifest": sorted(Manifest.model_json_schema()["properties"]),
        "manifest_file": sorted(FileEntry.model_json_schema()["properties"]),
    }


def test_public_surface_matches_the_frozen_copy():
    frozen = json.loads(FROZEN.read_text())
    assert current_api() == frozen, "public surface changed: run `python tests/test_frozen_api.py --update` if deliberate"


def test_every_env_variable_is_documented_in_the_readme():
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    missing = [name for name in current_api()["env"] if name not in readme]
    assert not missing, f"README lacks {missing}"


if __name__ == "__main__" and "--update" in sys.argv:
    FROZEN.write_text(json.dumps(current_api(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {FROZEN}")
