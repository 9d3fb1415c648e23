"""parse_overrides: whatever the order of a row's fields, its overrides and the problem it reports follow
OVERRIDE_RULES' order."""

from __future__ import annotations

import pytest

from batchgen.io.errors import RowError
from batchgen.io.overrides import OVERRIDE_FIELDS, parse_overrides


def test_overrides_come_in_the_rules_order():
    record = {"seed": 3, "prompt": "x", "stop": "a", "max_tokens": 5, "temperature": None, "n": 2}
    overrides = parse_overrides(record)
    assert overrides == {"n": 2, "max_tokens": 5, "seed": 3, "stop": ["a"]}
    assert list(overrides) == [name for name in OVERRIDE_FIELDS if name in overrides]


def test_the_first_invalid_override_in_the_rules_order_is_reported():
    with pytest.raises(RowError, match=r"^n=0 is invalid"):
        parse_overrides({"top_k": -5, "n": 0})


def test_a_row_without_overrides_has_none():
    assert parse_overrides({"prompt": "x", "id": 1, "max_tokens": None}) == {}
