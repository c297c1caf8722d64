"""shardkit.sizes.parse_size: one parser for every size parameter, errors naming the parameter."""

from __future__ import annotations

import pytest

from shardkit.errors import InputError
from shardkit.sizes import parse_size


def test_errors_name_the_python_parameter_given():
    with pytest.raises(InputError, match=r"invalid cache_limit='lots'; use e\.g\. 256MB"):
        parse_size("lots", "cache_limit")
    with pytest.raises(InputError, match="invalid shard_size='0'"):
        parse_size("0")


def test_minimum_allows_zero_where_a_parameter_does():
    assert parse_size("0", "cache_limit", minimum=0) == 0
    assert parse_size("1.5GB", "cache_limit", minimum=0) == 1_500_000_000
    with pytest.raises(InputError, match="at least 0 bytes"):
        parse_size(-1, "cache_limit", minimum=0)
