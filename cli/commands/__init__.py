"""The typer commands, one module each: they parse options and call the two engines below them.

``ckptrun.cli.main`` names each command by module path and imports it only when
it runs (``ckptrun.cli.lazy_commands``). Nothing below this package imports it.
"""
