"""A client of horovodrun's HTTP rendezvous server.

The server keeps byte values under ``<scope>/<key>``: ``PUT /<scope>/<key>`` with the value
as the body stores it (200), ``GET /<scope>/<key>`` answers 200 with the value or 404 while
there is none. Neither part may contain ``/``. horovodrun --gloo gives its ranks the server's
address in HOROVOD_GLOO_RENDEZVOUS_ADDR and HOROVOD_GLOO_RENDEZVOUS_PORT.
"""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request


class HTTPRendezvous:
    """The key-value store of a horovodrun rendezvous server at ``host:port``."""

    def __init__(self, host: str, port: int) -> None:
        self.base = f"http://{host}:{port}"

    def put(self, scope: str, key: str, value: bytes) -> None:
        """Stores ``value`` under ``scope/key``."""
        request = urllib.request.Request(
            f"{self.base}/{scope}/{key}", data=value, method="PUT"
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            answer.read()

    def get(self, scope: str, key: str) -> bytes | None:
        """The value under ``scope/key``, or ``None`` while there is none."""
        try:
            with urllib.request.urlopen(f"{self.base}/{scope}/{key}", timeout=10) as answer:
                return bytes(answer.read())
        except urllib.error.HTTPError as error:
            if error.code == 404:
                return None
            raise

    def wait(self, scope: str, key: str, timeout_s: float) -> bytes:
        """The value under ``scope/key`` once some rank has stored it.

        Raises:
            TimeoutError: none came within ``timeout_s`` seconds.
        """
        deadline = time.monotonic() + timeout_s
        delay = 0.01
        while True:
            value = self.get(scope, key)
            if value is not None:
                return value
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"rank 0 did not publish {scope}/{key} on the rendezvous server "
                    f"{self.base} within {timeout_s:g} s (HOROVOD_GLOO_TIMEOUT_SECONDS)"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.5)


def reachable_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host:port`` (where the other ranks can
    reach it, since they reach the same server); no packet is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, port))
        return str(probe.getsockname()[0])
