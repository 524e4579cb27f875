"""Hybrid sharding across 2 virtual hosts (root only; run under ``flock /tmp/distlab-cluster.lock``): only
shards cross the link, measured with the link's byte counter (tests/mpi/fsdp_hybrid.py)."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.mpi]


@pytest.mark.parametrize("world", ["core", "mixed"])
def test_hybrid_sharding_sends_only_shards_across_hosts(mpirun, virtual_cluster, world):
    job = mpirun("fsdp_hybrid.py", np=4, args=[world], cluster=virtual_cluster, timeout=300)
    assert job.stdout.count("only shards crossed the link") == 4, job.stdout
