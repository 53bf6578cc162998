"""A request's body, read within a size limit: `spanq serve`'s query route and the cluster's ingress both read
bodies so. Light on purpose: the ingress imports it without vLLM."""

from __future__ import annotations

from typing import Any

from spanq_integrations.query.limits import QueryLimitError, QueryLimits

__all__ = ["CLIENT_CLOSED_REQUEST", "body_too_large", "read_capped"]

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client gone before its request was read: a 4xx, never a 500


def body_too_large(limits: QueryLimits, size: int | None = None) -> QueryLimitError:
    what = f"{size} bytes" if size is not None else "larger than that"
    return QueryLimitError(
        "$", f"the body is {what}, over the server's limit max_body_bytes={limits.max_body_bytes} "
        "(spanq serve --max-body-bytes)"
    )


async def read_capped(request: Any, limit: int) -> bytes | None:
    """The body, or None as soon as it is over `limit` bytes — declared or received — so an oversized body is
    never held in memory. A client that closes the connection before its body has arrived gets (were it still
    listening) a 499, nginx's "client closed request": its hang-up is no server error and logs none."""
    from fastapi import HTTPException
    from starlette.requests import ClientDisconnect

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
    except ClientDisconnect:
        raise HTTPException(CLIENT_CLOSED_REQUEST, "the client closed the connection before its body arrived") from None
    return b"".join(chunks)
