"""Parsers for the sizes and shares a job is configured with, shared by every layer.

    parse_bytes("24GiB")            -> 25769803776
    parse_device_fraction("auto")   -> "auto";  parse_device_fraction("0.4") -> 0.4

Nothing here imports torch, torchtitan or another mop_train module, so the config, the operators
and the training loop can all use it without depending on each other.
"""

from __future__ import annotations

_BYTE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
               "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int, *, key: str = "value") -> int:
    """'24GiB' -> 25769803776, '512MB' -> 512e6, '0' -> 0. Raises ValueError naming `key`."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"{key} = {text} must be >= 0")
        return text
    s = str(text).strip().lower().replace(" ", "")
    num = s.rstrip("kmgtib")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in _BYTE_UNITS or not 0 <= value < float("inf"):   # (also refuses "nan" and "inf")
        raise ValueError(f"{key} = {text!r} is not a byte size; write e.g. \"0\", \"512MiB\" or \"24GiB\"")
    return int(value * _BYTE_UNITS[unit])


def names_a_unit(text: str | int) -> bool:
    """Whether a byte size is written with letters (a unit such as "GiB"), not as a bare count of bytes:
    the size arguments refuse a bare count where one was surely a typo ("--gpu-memory 80")."""
    return any(c.isalpha() for c in str(text))


def parse_device_fraction(value, *, key: str = "mop.offload_adamw.device_fraction") -> float | str:
    """"auto" or a number in [0, 1] (given as a string or a number): the share of the optimizer
    state kept on the device. Raises ValueError naming `key`."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    try:
        share = float(value)
    except (TypeError, ValueError):
        share = -1.0
    if isinstance(value, bool) or not 0.0 <= share <= 1.0:
        raise ValueError(f"{key} = {value!r} must be \"auto\" or a number in [0, 1] (the share of the "
                         "optimizer state kept on the device; 0 streams everything)")
    return share
