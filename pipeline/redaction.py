"""What a job may write of how it reached its data: the one place credentials are kept out of outputs.

Storage options (``--storage-options``: keys, headers, connection strings, token files) are how a job
reaches its data, not part of what it made, so no output holds their values: a saved config records the
names of the options set, each ``"***"`` (`redacted`), and a run that resumes takes them again from its
command line or environment. A URL may carry a credential too, in its userinfo (``user:password@``) or
its query string (an Azure SAS token, a signed URL): every URL a job saves or prints is written as
`public_url` writes it, and the lines it prints (errors, the traceback files they name) go through
`public_text`. Imports nothing of vitray's: settings, storage and the command line all use it.
"""

from __future__ import annotations

import re
from typing import Any

REDACTED = "***"
# A URL inside a text: its scheme, then up to the next blank or quote.
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")
_LOCAL = ("file", "local")  # as `pipeline.storage.is_local` reads a URL
_CONTAINER_AT_ACCOUNT = ("abfs", "abfss", "az")  # abfs://container@account...: no credential there


def redacted(value: Any) -> Any:
    """A secret setting's saved form: the names of a dict's entries, never a value (a header, a
    connection string or a token file's path is a credential whatever its name); None stays None."""
    if value is None:
        return None
    if isinstance(value, dict):
        return {str(k): REDACTED for k in value}
    return REDACTED


def public_url(url: str) -> str:
    """``url`` as every output, log line and message writes it: scheme, host and path, without the
    userinfo, query string or fragment that may carry a credential. A local path is itself (``?`` and
    ``#`` are file-name characters there)."""
    if "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    if scheme.lower() in _LOCAL:
        return url
    rest = rest.split("#", 1)[0].split("?", 1)[0]
    host, slash, path = rest.partition("/")
    user, at, host = host.rpartition("@")
    if at and scheme.lower() in _CONTAINER_AT_ACCOUNT and ":" not in user:
        host = f"{user}@{host}"
    return f"{scheme}://{host}{slash}{path}"


def public_text(text: str) -> str:
    """``text`` with every URL in it as `public_url` writes it: for lines a job prints or saves."""
    return _URL_IN_TEXT.sub(lambda m: public_url(m.group(0)), text) if "://" in text else text
