"""Covering arrays for the test grids: every pair of axis values (and every triple of the axes named as interacting)
in a few cases, chosen deterministically; the rest of the full product behind the ``full_grid`` marker.

A grid of seven axes that a full product runs as 1,728 cases is covered pairwise by a few dozen: a bug that needs two
settings at once (bf16 with head_dim 80, a GQA group of 7 with several queries) shows in some case of the covering
array, as in the full product. Where an interaction of three axes is known to matter (a kernel specialised by
backend, dtype and head size), ``stronger`` covers every triple of those axes too. The cases are picked greedily, each
the first case of the product (in its order) that covers the most combinations not covered yet, so the same axes
always give the same cases, whatever the machine.

The full product stays: the cases left out carry the ``full_grid`` marker, which the suite's conftest deselects
unless pytest runs with ``--full-grid`` (``make test-full-grid``).

>>> cases = covering_cases({"a": [0, 1], "b": [0, 1], "c": [0, 1]})
>>> len(cases)  # the four cases of the classic pairwise array of three binary axes
4
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache

import pytest

FULL_GRID = pytest.mark.full_grid


def _value_id(value) -> str:
    names = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float64": "fp64"}
    text = str(value)
    return names.get(text, text)


@lru_cache(maxsize=None)
def _greedy(sizes: tuple[int, ...], interactions: tuple[tuple[int, ...], ...], named: tuple[tuple[int, ...], ...],
            allowed: frozenset | None) -> tuple[int, ...]:  # fmt: skip
    """Indices (into the product of ``range(size)`` per axis) of the chosen cases, named ones included."""
    product = list(itertools.product(*[range(size) for size in sizes]))
    if allowed is not None:
        product = [row for row in product if row in allowed]
    keys = [[(axes, tuple(row[i] for i in axes)) for axes in interactions] for row in product]
    uncovered = {key for row_keys in keys for key in row_keys}
    chosen: list[int] = []
    index_of = {row: i for i, row in enumerate(product)}
    for row in named:
        i = index_of[row]
        chosen.append(i)
        uncovered.difference_update(keys[i])
    while uncovered:
        best, best_gain = -1, 0
        for i, row_keys in enumerate(keys):
            gain = sum(key in uncovered for key in row_keys)
            if gain > best_gain:
                best, best_gain = i, gain
        chosen.append(best)
        uncovered.difference_update(keys[best])
    return tuple(sorted(set(chosen)))


def covering_cases(
    axes: Mapping[str, Sequence],
    strength: int = 2,
    stronger: Iterable[Sequence[str]] = (),
    named: Iterable[Sequence] = (),
    where: Callable[..., bool] | None = None,
) -> list[tuple]:
    """The cases (tuples of values, in the axes' order) of a covering array over ``axes``.

    Parameters
    ----------
    axes : mapping of str to sequence
        The grid: each axis's name and its values.
    strength : int
        Every combination of this many axes' values appears in some case (2: pairwise).
    stronger : iterable of sequences of axis names
        Groups of axes whose every combination of values appears too (known interactions of more than
        ``strength`` axes).
    named : iterable of tuples
        Cases that are always included (edge cases named by a test), in the axes' order.
    where : callable, optional
        ``where(**case)`` is False for the cases that cannot run (left out of both arrays and the full product).
    """
    names = list(axes)
    values = [list(axes[name]) for name in names]
    sizes = tuple(len(v) for v in values)
    interactions = set(itertools.combinations(range(len(names)), min(strength, len(names))))
    for group in stronger:
        interactions.add(tuple(sorted(names.index(name) for name in group)))
    allowed = None
    if where is not None:
        allowed = frozenset(
            row
            for row in itertools.product(*[range(size) for size in sizes])
            if where(**{name: values[a][row[a]] for a, name in enumerate(names)})
        )
    named_rows = tuple(tuple(values[a].index(case[a]) for a in range(len(names))) for case in named)
    chosen = _greedy(sizes, tuple(sorted(interactions)), named_rows, allowed)
    product = [row for row in itertools.product(*[range(size) for size in sizes]) if allowed is None or row in allowed]
    return [tuple(values[a][product[i][a]] for a in range(len(names))) for i in chosen]


def grid(
    axes: Mapping[str, Sequence],
    strength: int = 2,
    stronger: Iterable[Sequence[str]] = (),
    named: Iterable[Sequence] = (),
    where: Callable[..., bool] | None = None,
) -> list:
    """``pytest.param`` cases of the full product of ``axes``: the covering array's as they are, every other case marked
    ``full_grid`` (run with ``--full-grid``). Use as ``@pytest.mark.parametrize(",".join(AXES), grid(AXES))``."""
    names = list(axes)
    covered = set(covering_cases(axes, strength, stronger, named, where))
    params = []
    for case in itertools.product(*[list(axes[name]) for name in names]):
        if where is not None and not where(**dict(zip(names, case))):
            continue
        marks = () if case in covered else (FULL_GRID,)
        params.append(pytest.param(*case, id="-".join(_value_id(v) for v in case), marks=marks))
    return params
