"""Store URLs: the Redis backends' schemes (``redis://``, ``rediss://`` (TLS),
``unix://``: Redis; ``redis+cluster://host:port[,host:port…]``, ``rediss+cluster://``:
Redis Cluster), and passwords redacted for display. A leaf: the backends and the
registry (:mod:`.registry`, which backend serves a URL) import it."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

REDIS_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")


def redact(url: str) -> str:
    """The URL with any password replaced by ``***`` (safe to print and log).

    Edits the string in place rather than re-assembling it (``urlunsplit`` would turn
    ``unix:///path`` into ``unix:/path``).
    """
    try:
        parts = urlsplit(url)
    except ValueError:  # not a well-formed URL: hide whatever could be a password
        url = re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)
        return re.sub(r"(password=)[^&#]*", r"\1***", url)
    if parts.password is not None:
        prefix = parts.scheme + "://"
        userinfo, _, hostpart = parts.netloc.rpartition("@")
        user = userinfo.split(":", 1)[0]
        url = prefix + f"{user}:***@{hostpart}" + url[len(prefix) + len(parts.netloc):]
    return re.sub(r"(password=)[^&#]*", r"\1***", url)
