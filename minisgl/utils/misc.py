from minisgl.config import ConfigError


def div_ceil(a: int, b: int) -> int:
    return (a + b - 1) // b


def div_even(a: int, b: int) -> int:
    """a / b, which must divide exactly (e.g. heads split across TP ranks)."""
    if a % b != 0:
        raise ConfigError(f"{a} is not divisible by {b}")
    return a // b
