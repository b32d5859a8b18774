"""Small helpers shared by the control path and the data path."""

import socket


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of size `b` hold `a` tokens."""
    return -(-a // b)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (the OS picks it): for a rendezvous or a server."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
