"""RowParams: a job's rows with the same overrides share one SamplingParams, equal to what row_params builds."""

from __future__ import annotations

import pytest

from batchgen.sample.params import RowParams, SamplingParams, row_params

DEFAULTS = SamplingParams(max_tokens=16, temperature=0.6)


def test_rows_without_overrides_get_the_defaults():
    assert RowParams(DEFAULTS)({}, 0) is DEFAULTS


def test_rows_with_the_same_overrides_share_the_parameters_row_params_builds():
    params_of = RowParams(DEFAULTS)
    first = params_of({"max_tokens": 40, "stop": "x"}, 0)
    assert first == row_params(DEFAULTS, {"max_tokens": 40, "stop": "x"}, 0)
    assert params_of({"max_tokens": 40, "stop": "x"}, 1) is first
    assert params_of({"max_tokens": 41, "stop": "x"}, 2).max_tokens == 41


def test_equal_values_of_other_types_are_other_overrides():
    """1, 1.0 and True are equal dict keys; each row keeps the value it gave."""
    params_of = RowParams(DEFAULTS)
    assert type(params_of({"seed": 1}, 0).seed) is int
    assert params_of({"seed": True}, 1).seed is True
    assert type(params_of({"temperature": 1}, 2).temperature) is int
    assert type(params_of({"temperature": 1.0}, 3).temperature) is float


def test_list_and_dict_values_are_built_per_row():
    params_of = RowParams(DEFAULTS)
    overrides = {"stop": ["a", "b"], "logit_bias": {"3": 1.0}}
    first, second = params_of(overrides, 0), params_of(overrides, 1)
    assert first == second == row_params(DEFAULTS, overrides, 0)
    assert first is not second


def test_each_row_with_invalid_overrides_raises_naming_itself():
    params_of = RowParams(DEFAULTS)
    for index in (3, 5):
        with pytest.raises(ValueError, match=rf"^row {index}: sampling.min_tokens=20 is invalid"):
            params_of({"min_tokens": 20}, index)
