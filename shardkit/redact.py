"""Keep credentials out of every message we raise or log.

Error text from botocore, aiohttp and fsspec can echo URLs with userinfo, presigned query strings or
``Credential=`` fragments, and a user's ``storage_options`` may hold keys that a cause string
repeats. Everything we put into a ``StorageError`` goes through :func:`redact` first.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["redact", "secret_values"]

MASK = "***"

# scheme://user:password@host -> scheme://***@host
_USERINFO = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s'\"]+@")
# Query parameters that carry signatures or tokens (presigned S3/GCS URLs, Azure SAS, OAuth).
_QUERY_SECRET = re.compile(
    r"(?i)([?&;](?:x-amz-signature|x-amz-credential|x-amz-security-token|x-goog-signature|"
    r"x-goog-credential|signature|sig|token|access_token|awsaccesskeyid|key|secret|password)=)[^&\s'\"]+"
)
# SigV4 authorization header fragments that some libraries put into exception text.
_AUTH_FRAGMENT = re.compile(
    r"(?i)((?:credential|signature|x-amz-security-token)\s*[=:]\s*)[^,&\s'\"]+"
)
# Option names whose values are secrets, in storage_options and nested client kwargs.
_SECRET_KEY = re.compile(r"(?i)(key|secret|token|password|passwd|credential|sas|auth)")
# Environment variables of the usual credential chains.
_SECRET_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_STORAGE_CONNECTION_STRING",
    "GOOGLE_OAUTH_ACCESS_TOKEN",
    "HF_TOKEN",
)
# Shorter values would mask innocent words (a key "a" must not blank out every "a").
_MIN_SECRET_LEN = 4


def secret_values(options: Mapping[str, Any] | None = None) -> list[str]:
    """The literal secret strings we know of: from ``options`` (recursively) and the environment."""
    found: list[str] = []

    def walk(obj: Any, sensitive: bool) -> None:
        if isinstance(obj, Mapping):
            for k, v in obj.items():
                walk(v, sensitive or bool(_SECRET_KEY.search(str(k))))
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, sensitive)
        elif sensitive and isinstance(obj, str) and len(obj) >= _MIN_SECRET_LEN:
            found.append(obj)
        elif sensitive and obj is not None and not isinstance(obj, (bool, int, float)):
            # e.g. aiohttp.BasicAuth(login, password): a namedtuple of strings.
            for v in getattr(obj, "__dict__", {}).values() if not isinstance(obj, tuple) else obj:
                walk(v, True)

    walk(options or {}, False)
    for name in _SECRET_ENV:
        value = os.environ.get(name, "")
        if len(value) >= _MIN_SECRET_LEN:
            found.append(value)
    # Longest first, so a secret that contains another is masked whole.
    return sorted(set(found), key=len, reverse=True)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with URL userinfo, signed query values, auth fragments and known secrets masked."""
    for s in secrets:
        if s:
            text = text.replace(s, MASK)
    text = _USERINFO.sub(r"\1" + MASK + "@", text)
    text = _QUERY_SECRET.sub(r"\1" + MASK, text)
    return _AUTH_FRAGMENT.sub(r"\1" + MASK, text)
