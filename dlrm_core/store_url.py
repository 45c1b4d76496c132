"""Serving-store URLs: which kind of store a URL names, checked without opening it or importing
the stores (torch), so that ``dlrm serve`` and ``dlrm publish`` refuse a bad one at once."""

from __future__ import annotations

from urllib.parse import urlparse

from dlrm_core.errors import ConfigError
from dlrm_core.secrets import redact_url


def check_store_url(url: str) -> str:
    """The kind of store ``url`` names, ``file`` or ``redis``, without opening it (so that a
    command refuses a bad URL before it starts anything).

    Raises:
        ConfigError: an unknown scheme (the URL shown without its password).
    """
    scheme = urlparse(url).scheme
    if scheme in ("file", ""):
        return "file"
    if scheme in ("redis", "rediss", "unix"):
        return "redis"
    raise ConfigError(f"store URL {redact_url(url)}: unknown scheme {scheme!r} "
                      "(use file://DIR, redis://host:port/db or rediss://host:port/db)")
