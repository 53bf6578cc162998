"""Joining Ray: a local Ray for this process, or an existing cluster whose address is checked first (Ray itself
waits minutes on an address that does not answer). Kept apart from `app.py`, which imports the serving stack
(vLLM): `spanq run --bulk --ray-address` names a wrong address in about a second, not after vLLM's import."""

from __future__ import annotations

import logging
import os
import socket

# An HTTP/2 client's opening (RFC 9113, 3.4): the preface, then an empty SETTINGS frame. Ray's GCS and its client
# server are gRPC servers, which answer with a SETTINGS frame of their own (a frame header's fourth byte is its
# type, 4); an HTTP/1 server answers with text or closes, and one that says nothing is not Ray either.
_H2_OPENING = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def _speaks_grpc(sock: socket.socket) -> bool:
    sock.sendall(_H2_OPENING)
    head = b""
    try:
        while len(head) < 9 and (chunk := sock.recv(9 - len(head))):
            head += chunk
    except OSError:
        return False
    return len(head) == 9 and head[3] == 4


def connect(address: str | None) -> None:
    """Start a local Ray (no address) or join a cluster (`ray://host:port`, `auto`, or `host:port`); a
    `ConnectionError` naming the address if it does not answer."""
    import warnings

    import ray

    probed = False
    if address and address != "auto":  # Ray itself waits minutes for an address that does not answer
        host, _, port = address.removeprefix("ray://").rpartition(":")
        if not port.isdigit():
            raise ConnectionError(f"{address!r} is not a Ray cluster address (host:port, ray://host:port or auto)")
        tls = os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true")  # (Ray's own reading of it)
        try:
            with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=5) as sock:
                is_ray = tls or _speaks_grpc(sock)  # Ray over TLS answers no plain opening: its own join checks it
        except OSError as e:
            raise ConnectionError(f"the Ray cluster at {address!r} does not answer: {e.strerror or e}") from None
        if not is_ray:
            raise ConnectionError(
                f"{address!r} is not a Ray cluster: something listens there but does not speak Ray's protocol "
                "(gRPC); give the head's GCS address (host:6379 by default) or its client server's (ray://host:10001), "
                "and for a cluster that uses TLS set RAY_USE_TLS=1 as its nodes do"
            )
        probed = not tls
    try:
        warnings.filterwarnings("ignore", message="Ray Client connection timed out")
        if address:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        else:  # a Ray of this process's own, stopped with it: its notice on token authentication is not the user's
            logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
            ray.init(address="local", include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as e:
        if probed:  # it answered as Ray does above, and refused this process
            raise ConnectionError(
                f"the Ray cluster at {address!r} answers but this process could not join it ({e}); a cluster with "
                "token authentication needs its token here (RAY_AUTH_TOKEN, or the file Ray reads it from), and "
                "a cluster runs one Ray version for all its processes"
            ) from None
        raise ConnectionError(f"the Ray cluster at {address!r} does not answer: {e}") from None
