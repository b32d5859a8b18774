"""Small helpers shared by the control path and the data path."""


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of size `b` hold `a` tokens."""
    return -(-a // b)
