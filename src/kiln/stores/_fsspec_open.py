"""Opening the fsspec file system of a :class:`kiln.stores._fsspec.FsspecStore`: options from
the environment and the caller, timeouts, one attempt per request."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from typing import Any

from .._base import StoreError

__all__ = ["open_filesystem"]

_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}  # protocol -> jax-kiln extra


def open_filesystem(
    url: str, shown: str, *, timeout: float, connect_timeout: float,
    storage_options: Mapping[str, Any] | None,
) -> tuple[Any, str, tuple[str, ...]]:
    """The file system of ``url`` (``shown``: the URL as messages name it), the path under it,
    and its protocols; see :class:`kiln.stores._fsspec.FsspecStore` for the arguments.

    Raises:
        StoreError: fsspec, or the package for the URL's protocol, is not installed, or the
            URL is not one fsspec knows.
    """
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    try:
        import fsspec
        import fsspec.core
    except ImportError:
        raise StoreError(f"kiln store {shown!r} needs fsspec: pip install "
                         f"'jax-kiln[{_EXTRAS.get(protocol, 's3')}]'") from None
    try:
        cls = fsspec.get_filesystem_class(protocol)
    except ImportError:
        extra = _EXTRAS.get(protocol)
        hint = (f"pip install 'jax-kiln[{extra}]'" if extra else
                f"install the fsspec implementation for {protocol}://")
        raise StoreError(f"kiln store {shown!r} needs a package that is not installed: "
                         f"{hint}") from None
    except ValueError:
        raise StoreError(f"kiln store {shown!r}: fsspec knows no protocol {protocol!r}") from None
    protocols = cls.protocol if isinstance(cls.protocol, tuple | list) else (cls.protocol,)
    options = _env_options(tuple(protocols))
    options.update(storage_options or {})
    if "s3" in protocols:
        config = {"connect_timeout": connect_timeout, "read_timeout": timeout,
                  # botocore's max_attempts counts retries; total_max_attempts all tries
                  "retries": {"total_max_attempts": 1}}
        try:
            config.update(options.get("config_kwargs") or {})
        except (TypeError, ValueError) as e:
            raise StoreError(f"kiln store {shown!r}: the fsspec option config_kwargs "
                             f"(FSSPEC_S3_CONFIG_KWARGS) must be a mapping ({e})") from None
        options["config_kwargs"] = config
    options["skip_instance_cache"] = True  # our own instance: our timeouts, no retries
    options.setdefault("use_listings_cache", False)  # others write here too
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except ImportError as e:
        raise StoreError(f"kiln store {shown!r} needs a package that is not installed "
                         f"({e})") from None
    except (ValueError, TypeError) as e:
        raise StoreError(f"kiln store {shown!r} cannot be opened with fsspec ({e})") from None
    if isinstance(getattr(fs, "retries", None), int):
        fs.retries = 1  # s3fs, gcsfs: one attempt (a hung store costs one timeout)
    if "s3" in protocols:
        # s3fs makes its client (botocore's service model: 0.1-1 s of local work) at the
        # first request: made here, so a process's first contact with the store, bounded by
        # remote_timeout, is only the request (a CI run timed the client out at 0.8 s)
        with contextlib.suppress(Exception):  # (the first request says what is wrong)
            fs.connect()
    return fs, root, tuple(protocols)


def _env_options(protocols: tuple[str, ...]) -> dict[str, Any]:
    """fsspec's options for ``protocols`` from its config (files, and the environment as it was
    when fsspec was imported), updated from the environment as it is now, by fsspec's rules:
    ``FSSPEC_<PROTOCOL>`` a JSON object, ``FSSPEC_<PROTOCOL>_<OPTION>`` one option (its value
    JSON-decoded when it parses)."""
    import fsspec.config

    options: dict[str, Any] = {}
    for proto in protocols:
        options.update(fsspec.config.conf.get(proto, {}))
    for proto in protocols:
        whole = os.environ.get(f"FSSPEC_{proto.upper()}")
        if whole:
            with contextlib.suppress(ValueError):
                parsed = json.loads(whole)
                if isinstance(parsed, dict):
                    options.update(parsed)
    for proto in protocols:
        prefix = f"FSSPEC_{proto.upper()}_"
        for name, text in os.environ.items():
            if name.startswith(prefix) and len(name) > len(prefix):
                value: Any = text
                with contextlib.suppress(ValueError):
                    value = json.loads(text)
                options[name[len(prefix):].lower()] = value
    return options
