"""The remembered validation of the ops' per-call checks (ops/_common.memo_check)."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_metaltile.ops import _common
from mlx_metaltile.ops._common import memo_check


def _counting(fn):
    calls = []

    def check(*args, **kwargs):
        calls.append(args)
        return fn(*args, **kwargs)

    return memo_check(check), calls


def test_same_metadata_is_checked_once_and_values_never_read():
    check, calls = _counting(lambda a, n: (a.shape[0] * n,))
    a, b = mx.zeros((3, 2)), mx.ones((3, 2))
    assert check(a, 2) == (6,)
    assert check(b, 2) == (6,)  # same shape, dtype and scalar: remembered
    assert len(calls) == 1
    assert check(mx.zeros((4, 2)), 2) == (8,)  # another shape: checked
    assert check(a.astype(mx.float16), 2) == (6,)  # another dtype: checked
    assert check(a, np.int64(2)) == (6,)  # a NumPy scalar is another key
    assert check(a, 2.0) == (6.0,)  # so is a float equal to the int
    assert len(calls) == 5


def test_a_refusal_is_never_remembered():
    def refuse_odd(a, n):
        if n % 2:
            raise ValueError("[op] n must be even")
        return n

    check, calls = _counting(refuse_odd)
    for _ in range(2):
        with pytest.raises(ValueError, match=r"^\[op\]"):
            check(mx.zeros(2), 3)
    assert len(calls) == 2
    assert check(mx.zeros(2), 4) == 4


def test_results_holding_arrays_and_unhashable_arguments_are_not_remembered():
    check, calls = _counting(lambda a, n: {"a": a} if n else [n])
    check(mx.zeros(2), 1)
    check(mx.zeros(2), 1)
    assert len(calls) == 2  # the result holds an array
    check(mx.zeros(2), [0])
    check(mx.zeros(2), [0])
    assert len(calls) == 4  # a list argument
    check(mx.zeros(2), n=0)
    assert len(calls) == 5  # keyword arguments


def test_a_full_memory_forgets_its_oldest(monkeypatch):
    """Past the cap the oldest key goes: a decode loop's kv_len (a new key each token) keeps
    its latest results remembered, not its first ones."""
    monkeypatch.setattr(_common, "_CHECKED_MAX", 3)
    check, calls = _counting(lambda a, n: n)
    for n in range(5):
        check(mx.zeros(2), n)
    assert len(check.memory) == 3
    check(mx.zeros(2), 4)  # the latest: remembered
    assert len(calls) == 5
    check(mx.zeros(2), 0)  # the first: forgotten, checked again
    assert len(calls) == 6
