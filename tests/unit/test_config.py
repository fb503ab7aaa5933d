"""Configuration parsing."""

import pytest

from distore_ucx.config import NodeConfig, parse_size
from distore_ucx.errors import ConfigError


@pytest.mark.parametrize(
    "text, value",
    [("4GiB", 4 << 30), ("512MiB", 512 << 20), ("1k", 1000), ("2M", 2_000_000), ("1024", 1024),
     (77, 77), ("1.5GiB", 3 << 29), ("64 KiB", 64 << 10), ("3GB", 3_000_000_000)],
)
def test_sizes(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "GiB", "-1", "4XB", "four"])
def test_bad_sizes_say_what_is_expected(bad):
    with pytest.raises(ConfigError, match="is not a size"):
        parse_size(bad)


def test_tiny_arena_is_refused():
    with pytest.raises(ConfigError, match="too small"):
        NodeConfig(control="127.0.0.1:1", arena_bytes=1000)
