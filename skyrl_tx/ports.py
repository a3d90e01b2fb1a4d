"""free_local_port: a port for a listener that binds it later, chosen outside the kernel's ephemeral range.

A port from bind(("127.0.0.1", 0)) comes from the ephemeral range, the same range every outbound connect() draws its
local port from. Between choosing such a port and the listener binding it (a spawned rank or server first imports
torch: seconds), any client may be given it, including a client that retries connect() to that very port before
anything listens on it (a loopback TCP self-connect); the listener's bind then fails. Ports below the range are only
ever taken by an explicit bind, so choosing one there and checking it binds now leaves no such window.
"""

from __future__ import annotations

import random
import socket

_LOWEST = 15000  # above the well-known and common service ports (5432, 8000, 8080, 9000, ...)
_DEFAULT_EPHEMERAL_LOW = 32768


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_LOW


def _binds(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_local_port(host: str = "127.0.0.1") -> int:
    """A port that binds on `host` now and that no outbound connection will be given meanwhile."""
    high = _ephemeral_low()
    candidates = random.Random().sample(range(_LOWEST, high), k=min(256, max(high - _LOWEST, 0)))
    for port in candidates:
        if _binds(host, port):
            return port
    with socket.socket() as s:  # an unusual range setting: fall back to the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]
