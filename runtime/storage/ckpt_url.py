"""What a checkpoint location names: a local directory or an object-store URL, never a directory called ``s3:``.

``--ckpt-dir`` (and every command that takes a checkpoint dir) accepts a plain
path, ``file://PATH`` or any fsspec URL (``s3://bucket/prefix``, ``gs://…``,
``memory://…``). A URL whose fsspec implementation is not installed is refused
with the pip package to install, before anything runs: a URL either works or
is refused. ``s3:/bucket`` (one slash, what ``pathlib`` makes of a URL) is
refused too, so a URL mangled on its way in never becomes a local directory.

Credentials are never taken here: fsspec and the storage library read them
from their usual places (the environment, ``~/.aws``, instance metadata) and
from ``--storage-option key=value``. fsspec is imported only for a URL, so the
local path stays free of it. Importable without torch.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://(.*)$")
_MANGLED = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):/+")
_SECRET_WORDS = ("key", "secret", "token", "password", "credential", "session")


class UrlError(ValueError):
    """A checkpoint location cannot be used; ``hint`` says what to do instead."""

    def __init__(self, message: str, hint: str) -> None:
        super().__init__(message)
        self.hint = hint


@dataclass(frozen=True)
class StoreUrl:
    """An object-store location: ``protocol://path`` with no trailing slash."""

    protocol: str
    path: str  # what fsspec calls the path: bucket/prefix for s3

    @property
    def url(self) -> str:
        return f"{self.protocol}://{self.path}"

    def join(self, *parts: str) -> str:
        """The fsspec path (no protocol) of ``parts`` under this location."""
        return "/".join([self.path, *parts]) if self.path else "/".join(parts)

    def __str__(self) -> str:
        return self.url


Location = Path | StoreUrl


def parse(text: str | Path) -> Location:
    """A local :class:`Path` or a supported :class:`StoreUrl`; :class:`UrlError` when neither."""
    if isinstance(text, Path):
        text = str(text)
    match = _SCHEME.match(text)
    if match is None:
        mangled = _MANGLED.match(text)
        if mangled and len(mangled.group(1)) > 1:  # one letter: a Windows drive, not a scheme
            raise UrlError(f"{text!r} looks like a URL with a slash missing",
                           f"write {mangled.group(1)}://{text[mangled.end():]} (two slashes)")
        return Path(text)
    protocol, rest = match.group(1).lower(), match.group(2).strip("/")
    if protocol == "file":
        return Path("/" + rest if match.group(2).startswith("/") else rest)
    if not rest:
        raise UrlError(f"{text!r} names no bucket or path", f"write {protocol}://BUCKET/PREFIX")
    check_supported(protocol)
    return StoreUrl(protocol, rest)


def check_supported(protocol: str) -> None:
    """Refuse a protocol fsspec does not know or whose implementation is not installed, naming the package."""
    try:
        import fsspec
    except ImportError:
        raise UrlError(f"{protocol}:// checkpoints need fsspec, which is not installed",
                       "pip install 'ckptrun[s3]' (fsspec and s3fs), or use a local --ckpt-dir") from None
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError as exc:
        package = _package_of(protocol)
        raise UrlError(f"{protocol}:// checkpoints need the {package} package, which is not installed ({exc})",
                       f"pip install {package}") from None
    except ValueError:
        raise UrlError(f"{protocol}:// is not a storage protocol fsspec knows",
                       "use a local directory, s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or another fsspec URL") from None


def _package_of(protocol: str) -> str:
    from fsspec.registry import known_implementations

    module = known_implementations.get(protocol, {}).get("class", protocol).split(".")[0]
    return module or protocol


def filesystem(url: StoreUrl, options: dict[str, Any] | None = None) -> Any:
    """A fresh fsspec filesystem for ``url`` (no instance or listing cache: every listing is current)."""
    import fsspec

    kwargs = {"skip_instance_cache": True, "use_listings_cache": False, **(options or {})}
    return fsspec.filesystem(url.protocol, **kwargs)


def parse_storage_options(items: Iterable[str] | str | None) -> dict[str, Any]:
    """``key=value`` items (a list, or one comma-separated string) to fsspec options; values are
    JSON when they parse (``true``, ``3``, ``{"a": 1}``), else strings. A nested key ``a.b=1``
    becomes ``{"a": {"b": 1}}`` (s3fs's ``client_kwargs.region_name``)."""
    if isinstance(items, str):
        items = [part for part in items.split(",") if part.strip()]
    options: dict[str, Any] = {}
    for item in items or ():
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise UrlError(f"--storage-option {item!r} is not key=value", "write e.g. --storage-option endpoint_url=http://host:9000")
        try:
            value: Any = json.loads(text)
        except ValueError:
            value = text
        *parents, leaf = key.strip().split(".")
        holder = options
        for part in parents:
            holder = holder.setdefault(part, {})
        holder[leaf] = value
    return options


def is_secret(key: str) -> bool:
    """Storage options that look like credentials: passed to workers, never written to the run dir."""
    return any(word in key.lower() for word in _SECRET_WORDS)


def split_secrets(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``options`` as (what may be written, the credentials), at every nesting level: s3fs takes
    ``client_kwargs.aws_secret_access_key`` as well as a top-level ``secret``."""
    public: dict[str, Any] = {}
    secret: dict[str, Any] = {}
    for key, value in options.items():
        if is_secret(str(key)):
            secret[key] = value
        elif isinstance(value, dict):
            inner_public, inner_secret = split_secrets(value)
            if inner_public or not inner_secret:
                public[key] = inner_public
            if inner_secret:
                secret[key] = inner_secret
        else:
            public[key] = value
    return public, secret


def merge_options(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` laid over it, nested dicts merged key by key (the inverse of :func:`split_secrets`)."""
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge_options(merged[key], value)
        else:
            merged[key] = value
    return merged
