"""Grid bookkeeping at 16 gloo ranks through the real collective paths (issue 26): save -> reshard -> load
bit-exact, metadata size independent of the world size, no work on a rank that requests nothing. Scenarios in
``_scale_scenarios.py``."""

import pytest

from multirank import each_scenario, launch_fixture

launched = launch_fixture("_scale_scenarios", worlds=(16,), timeout_s=600, threads=1)


@pytest.mark.multiproc
@each_scenario("_scale_scenarios", worlds=(16,))
def test_sixteen_ranks(launched, world, scenario):
    launched.check(scenario, world)
