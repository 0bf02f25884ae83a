"""Request fields the gateway cannot honour: a clear 400 rather than silently ignoring them."""

from __future__ import annotations

from gateway.body import Fields
from gateway.errors import invalid


def reject_unsupported(body: Fields) -> None:
    if body.has("functions") or body.has("function_call"):
        raise invalid("the legacy 'functions' / 'function_call' fields are not supported: use 'tools'",
                      param="functions" if body.has("functions") else "function_call")
    if body.has("audio"):
        raise invalid("audio output is not supported", param="audio")
    if body.has("modalities") and body.raw("modalities") != ["text"]:
        raise invalid("only text output is supported", param="modalities")
