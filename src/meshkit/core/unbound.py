"""
Builtin methods called without a method lookup
==============================================

``name.lower()`` in a compiled module looks ``lower`` up on the type of ``name``
(the type's method cache, its dict on a miss) and then calls it. A request makes
dozens of such calls, on a data cache that the kernel's work between two
requests has mostly emptied. The unbound method, read once into a ``Final`` (a
C static in a compiled build), is called with its object as the first argument
and skips the lookup (``benchmarks/RESULTS.md``, "Builtin methods without a
lookup").

Only for values typed ``bytes``: the compiled build already refuses anything
else there, and ``bytes.lower`` refuses a ``bytearray`` in the interpreted one
alike.

A one-byte ``in`` is written with the byte's number (``13 in data``): given a
``bytes`` operand, CPython 3.11 first tries it as an integer, raising and
clearing a TypeError before it searches.
"""

from __future__ import annotations

from typing import Final

lower: Final = bytes.lower
islower: Final = bytes.islower
isdigit: Final = bytes.isdigit
isspace: Final = bytes.isspace
find: Final = bytes.find
replace: Final = bytes.replace


def count_upto(data: bytes, byte: bytes, limit: int) -> int:
    """How many times the single byte ``byte`` is in ``data``, ``limit`` at most.

    By a ``replace`` of it by nothing: its arguments are parsed as a fast call and
    it finds the byte with memchr, while ``count`` parses a tuple of arguments and
    compares byte after byte (1.25K against 1.6K instructions per call on a
    response head, compiled; 165 against 185 ns on 109 bytes). Its copy is made and
    freed at once: for data of a KiB or two at most (``requests._more_than``).
    """
    return len(data) - len(replace(data, byte, b"", limit))
