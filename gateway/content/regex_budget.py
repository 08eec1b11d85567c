"""What compiling a regex costs XGrammar, estimated from its parse before any worker sees it.

XGrammar expands a bounded repeat (`{m,n}`) into copies of what it repeats, and the cost of a
repeat nested in another grows much faster than the copies alone: measured in a worker,
`(?:a{0,100}){0,100}` compiled in 0.6 s, `(?:a{0,150}){0,150}` in 35 s and the 19 characters
`(?:a{0,300}){0,300}` froze every stream of the llm worker for 109 s (the compile runs inside
the pipeline's step); a flat `a{0,50000}` took 0.9 s. So two numbers are budgeted: the size
of the expansion (every repeated piece times its count) and the product of the counts of
repeats nested in one another.
"""

from __future__ import annotations

import re._parser as sre  # NOTE: the parser of `re` itself; the pattern already compiled
from typing import Any

MAX_SIZE = 100_000
MAX_NESTED = 10_000


def _count(low: int, high: int) -> int:
    """The copies a repeat makes: its upper bound, or one more than its lower when open."""
    return max(1, low + 1 if high == sre.MAXREPEAT else high)


def _cost(items: Any) -> tuple[int, int, int]:
    """(size of the expansion, the largest product of nested counts, how many repeats nest
    in that product) of a parsed sequence."""
    size, product, depth = 0, 1, 0
    for op, arg in items:
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, getattr(sre, "POSSESSIVE_REPEAT", None)):
            low, high, sub = arg
            n = _count(low, high)
            inner, inner_product, inner_depth = _cost(sub)
            size += inner * n
            if inner_product * n > product:
                product, depth = inner_product * n, inner_depth + 1
        elif op == sre.SUBPATTERN:
            inner, inner_product, inner_depth = _cost(arg[-1])
            size += inner
            if inner_product > product:
                product, depth = inner_product, inner_depth
        elif op == sre.BRANCH:
            for alternative in arg[1]:
                inner, inner_product, inner_depth = _cost(alternative)
                size += inner
                if inner_product > product:
                    product, depth = inner_product, inner_depth
        else:
            size += 1
    return size, product, depth


def too_costly(pattern: str) -> str | None:
    """Why compiling `pattern` would cost too much, or None. `pattern` compiles with `re`."""
    size, product, depth = _cost(sre.parse(pattern))
    if size > MAX_SIZE:
        return (f"its repeats expand to {size:,} pieces, more than {MAX_SIZE:,} (write an "
                "open repeat such as + or * for long runs)")
    if depth > 1 and product > MAX_NESTED:
        return (f"its nested repeats multiply to {product:,} copies, more than "
                f"{MAX_NESTED:,}")
    return None
