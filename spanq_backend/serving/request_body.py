"""A request's body, read within a size limit: `spanq serve`'s query route and the cluster's ingress both read
bodies so. Light on purpose: the ingress imports it without vLLM."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from spanq_integrations.query.limits import QueryLimitError, QueryLimits

__all__ = ["CLIENT_CLOSED_REQUEST", "Oversized", "body_too_large", "read_capped"]

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client gone before its request was read: a 4xx, never a 500


@dataclass(frozen=True)
class Oversized:
    """What `read_capped` returns instead of a body over its limit: how large the body is known to be — its
    declared length (`declared`), or what had arrived when reading stopped."""

    size: int
    declared: bool


def body_too_large(limits: QueryLimits, size: int | Oversized) -> QueryLimitError:
    if isinstance(size, Oversized):
        what = f"{size.size} bytes" if size.declared else f"at least {size.size} bytes (reading stopped there)"
    else:
        what = f"{size} bytes"
    return QueryLimitError(
        "$", f"the body is {what}, over the server's limit max_body_bytes={limits.max_body_bytes} "
        "(spanq serve --max-body-bytes)"
    )


async def read_capped(request: Any, limit: int) -> bytes | Oversized:
    """The body, or as soon as it is over `limit` bytes — declared or received — how large it is known to be
    (`Oversized`), so an oversized body is never held in memory. A client that closes the connection before its
    body has arrived gets (were it still listening) a 499, nginx's "client closed request": its hang-up is no
    server error and logs none."""
    from fastapi import HTTPException
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return Oversized(int(declared), declared=True)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return Oversized(size, declared=False)
            chunks.append(chunk)
    except ClientDisconnect:
        raise HTTPException(CLIENT_CLOSED_REQUEST, "the client closed the connection before its body arrived") from None
    return b"".join(chunks)
