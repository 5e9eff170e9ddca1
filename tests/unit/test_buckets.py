"""Length buckets: the static shapes the model runner pads to."""

from __future__ import annotations

import pytest

from neuronfleet.runtime.engine.config import default_length_buckets, pick_bucket


def test_default_buckets_are_sorted_end_at_max_len_and_bound_padding():
    for max_len in (8, 100, 2048, 8192):
        for smallest, per_octave, waste in ((16, 4, 0.25), (64, 2, 0.5), (1, 4, 0.25)):
            buckets = default_length_buckets(max_len, smallest, per_octave)
            assert buckets == sorted(set(buckets)) and buckets[-1] == max_len
            for n in range(smallest + 1, max_len + 1):
                assert pick_bucket(buckets, n) <= n * (1 + waste)
    assert default_length_buckets(2048, 64, 2)[:5] == [64, 96, 128, 192, 256]
    assert default_length_buckets(64, 16, 4) == [16, 20, 24, 28, 32, 40, 48, 56, 64]
    assert default_length_buckets(20, 1, 4) == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20]


def test_pick_bucket_refuses_what_no_bucket_holds():
    assert pick_bucket([16, 32], 17) == 32
    assert pick_bucket([16, 32], 16) == 16
    with pytest.raises(ValueError, match="33 exceeds the largest bucket 32"):
        pick_bucket([16, 32], 33)
