"""``--storage-option KEY=VALUE`` for the commands that read snapshots (verify, export, estimate-rto).

One declaration, so every command that takes a store URL or a run whose snapshots live in a store
takes the same options as ``launch`` (the endpoint, the region; credentials too, never written).
"""

from __future__ import annotations

from typing import Any

import typer

HELP = ("fsspec option of the object store, KEY=VALUE (repeatable), as launch takes it, e.g. endpoint_url=http://minio:9000; "
        "for a run directory, over its stored ones.")


def storage_option_flag() -> Any:
    return typer.Option(None, "--storage-option", metavar="KEY=VALUE", help=HELP, show_default=False)
