"""Joining Ray: a local Ray for this process, or an existing cluster whose address is checked first (Ray itself
waits minutes on an address that does not answer). Kept apart from `app.py`, which imports the serving stack
(vLLM): `spanq run --bulk --ray-address` names a wrong address in about a second, not after vLLM's import."""

from __future__ import annotations

import logging
import socket


def connect(address: str | None) -> None:
    """Start a local Ray (no address) or join a cluster (`ray://host:port`, `auto`, or `host:port`); a
    `ConnectionError` naming the address if it does not answer."""
    import warnings

    import ray

    if address and address != "auto":  # Ray itself waits minutes for an address that does not answer
        host, _, port = address.removeprefix("ray://").rpartition(":")
        if not port.isdigit():
            raise ConnectionError(f"{address!r} is not a Ray cluster address (host:port, ray://host:port or auto)")
        try:
            with socket.create_connection((host or "127.0.0.1", int(port)), timeout=5):
                pass
        except OSError as e:
            raise ConnectionError(f"the Ray cluster at {address!r} does not answer: {e.strerror or e}") from None
    try:
        warnings.filterwarnings("ignore", message="Ray Client connection timed out")
        if address:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        else:
            ray.init(address="local", include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as e:
        raise ConnectionError(f"the Ray cluster at {address!r} does not answer: {e}") from None
