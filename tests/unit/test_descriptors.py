"""How many client connections fit under the open files limit (orchestrator/frontend/descriptors.py)."""

import pytest

from orchestrator.frontend.descriptors import connection_cap


@pytest.mark.parametrize("configured, limit, cap", [
    (None, 1024, 922),  # the limit less a reserve of 10%
    (None, 256, 192),  # ... and at least 64
    (200, 1024, 200),  # what is configured, when it fits
    (5000, 1024, 922),  # lowered to what fits
    (300, None, 300),  # limit unknown: what is configured
    (None, None, None),
])
def test_the_connection_cap_keeps_a_reserve_of_descriptors(configured, limit, cap):
    assert connection_cap(configured, limit) == cap
