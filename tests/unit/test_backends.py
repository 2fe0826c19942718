from __future__ import annotations

import pytest

from epd_proxy.backends import Instance, reaching
from epd_proxy.errors import BackendUnreachable


def test_a_timeout_with_the_stage_limit_off_is_still_described():
    with pytest.raises(BackendUnreachable, match="timed out while connecting") as err:
        with reaching(Instance("http://e", "encode"), "encode", "Encoder request", None):
            raise TimeoutError
    assert err.value.status == 504


def test_dp_ranks_rotate_per_instance():
    inst = Instance("http://pd", "prefill_decode", dp_size=3)
    assert [inst.next_dp_rank() for _ in range(5)] == [0, 1, 2, 0, 1]


def test_busy_counts_in_flight_even_on_errors():
    inst = Instance("http://e", "encode")
    with pytest.raises(RuntimeError), inst.busy():
        assert inst.inflight == 1
        raise RuntimeError
    assert inst.inflight == 0
