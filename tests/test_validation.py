"""refkv.validation: the one home of parameter checks, tested on its own.

Every entry point's refusals go through these helpers, so their message shape (one line,
the parameter's name first, the allowed range, the value shown short) is pinned here once.
"""

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from refkv.validation import MAX_CONTEXT, check_choice, check_context, check_float, check_int, check_size, shown


@given(st.integers(-10**6, 10**6), st.integers(-10**6, 10**6), st.integers(-10**6, 10**6))
def test_check_int_accepts_exactly_the_closed_range(value, a, b):
    low, high = min(a, b), max(a, b)
    if low <= value <= high:
        assert check_int("n", value, low, high) == value
    else:
        with pytest.raises(ValueError, match=rf"^n must be an integer in \[{low}, {high}\], got {value}$"):
            check_int("n", value, low, high)


@pytest.mark.parametrize("value", [True, False, 1.0, "3", None, np.float32(2.0), [1]])
def test_check_int_refuses_what_is_not_an_integer(value):
    with pytest.raises(ValueError, match=r"^budget must be an integer >= 1, got "):
        check_int("budget", value, 1)


def test_check_int_returns_a_python_int_for_numpy_integers():
    out = check_int("n", np.int64(7), 0)
    assert out == 7 and type(out) is int


def test_check_size_names_where_the_bound_comes_from():
    assert check_size("n_layers", 3, 1, 4) == 3
    with pytest.raises(ValueError, match=r"^n_layers must be an integer in \[1, 4\], got 5 \(the file's header\)$"):
        check_size("n_layers", 5, 1, 4, why="the file's header")


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, np.float32("nan"), 10**400])
def test_check_float_refuses_every_non_finite_value(value):
    with pytest.raises(ValueError, match=r"^tol must be a finite number in \(-inf, inf\), got "):
        check_float("tol", value)


@pytest.mark.parametrize("kwargs, inside, outside", [
    ({"low": 0.0}, [0.0, 1e300], [-1e-300]),
    ({"low": 0.0, "low_open": True}, [1e-300], [0.0]),
    ({"low": 0.0, "high": 1.0}, [0.0, 0.5, 1.0], [-0.1, 1.1]),
    ({"low": 0.0, "high": 1.0, "high_open": True}, [0.0, 0.999], [1.0]),
])
def test_check_float_bounds_open_and_closed(kwargs, inside, outside):
    for value in inside:
        assert check_float("p", value, **kwargs) == value
    for value in outside:
        with pytest.raises(ValueError, match=r"^p must be a finite number in "):
            check_float("p", value, **kwargs)


def test_check_float_message_draws_the_interval_it_checks():
    with pytest.raises(ValueError, match=r"in \(0, 1\], got 0.0$"):
        check_float("ratio", 0.0, 0.0, 1.0, low_open=True)
    with pytest.raises(ValueError, match=r"in \[0, inf\), got -1$"):
        check_float("eta", -1, 0.0)
    with pytest.raises(ValueError, match=r"got True$"):
        check_float("eta", True)


def test_check_choice_lists_the_choices():
    assert check_choice("dtype", "float32", ["float32", "float64"]) == "float32"
    with pytest.raises(ValueError, match=r"^dtype must be one of 'float32', 'float64', got 'int8'$"):
        check_choice("dtype", "int8", ("float32", "float64"))


def test_check_context_refuses_a_prompt_past_the_model_context():
    assert check_context(2048, 2048) == 2048
    with pytest.raises(ValueError, match=r"^prompt has 2049 tokens, more than the model's context of 2048"):
        check_context(2049, 2048)
    assert MAX_CONTEXT == 2**17


@given(st.one_of(st.integers(), st.text(), st.floats(allow_nan=True), st.lists(st.integers())))
def test_shown_is_always_one_short_line(value):
    text = shown(value)
    assert len(text) <= 60 and "\n" not in text


def test_shown_cuts_long_values_and_huge_integers():
    assert shown("x" * 100).endswith("...") and len(shown("x" * 100)) == 60
    assert shown(10**400) == "an integer of about 1329 bits"  # too large even for a float
    assert shown(10**70) == "1.000e+70"
    assert shown(5) == "5"
