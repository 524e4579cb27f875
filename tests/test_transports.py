"""The device transport a group chooses from its ranks' placements (a pure function: a table of cases)."""
import numpy as np
import pytest

from distlab.comm.transports import Placement, choose, reducer_mode

GPU_A, GPU_B = 0xA1, 0xB1
NCCL = 22809  # the NCCL version code a rank has (2.28.9); 0: none


def ranks(*specs, setting="auto", **more):
    """One Placement per (node, device, device_id, peers, nccl, cuda_aware) spec (``more``: the other fields)."""
    return [Placement(*spec, setting=setting, **more) for spec in specs]


def two_by_two(nccl=NCCL, setting="auto", **more):
    """Two nodes (keys 0 and 2) of two ranks, each rank on a device of its own (no peer access across nodes)."""
    return ranks((0, 0xA1, 0, 0b10, nccl, False), (0, 0xA3, 1, 0b01, nccl, False), (2, 0xB1, 0, 0b10, nccl, False),
                 (2, 0xB3, 1, 0b01, nccl, False), setting=setting, **more)


@pytest.mark.parametrize("placements, expected", [
    (ranks((0, GPU_A, 0, 0, True, False), (0, GPU_A, 0, 0, True, False)), "ipc"),          # 2 ranks, one GPU
    (ranks((0, GPU_A, 0, 0b10, True, False), (0, GPU_B, 1, 0b01, True, False)), "ipc"),    # peers on one node
    (ranks((0, GPU_A, 0, 0, 0, False), (0, GPU_B, 1, 0, 0, False)), "staged"),             # no peer access, no NCCL
    (ranks((0, GPU_A, 0, 0, 0, True), (0, GPU_B, 1, 0, 0, True)), "mpi"),                  # ... CUDA-aware MPI
    (ranks((0, GPU_A, 0, 0, 0, False), (2, GPU_B, 0, 0, 0, False)), "staged"),             # two nodes
    (ranks((0, GPU_A, 0, 0, False, True), (2, GPU_B, 0, 0, False, True)), "mpi"),
    (ranks((0, 0, 0, 0, False, False), (0, 0, 0, 0, False, False)), "none"),               # no device at all
    (ranks((0, GPU_A, 0, 0, False, False), (0, 0, 0, 0, False, False)), "staged"),         # one rank without
    (ranks((0, GPU_A, 0, 0, False, False)), "staged"),                                      # one rank
    (ranks((0, GPU_A, 0, 0, False, False), (0, GPU_A, 0, 0, False, False), setting="ipc"), "ipc"),
    (ranks((0, GPU_A, 0, 0b10, True, False), (0, GPU_B, 1, 0b01, True, False), setting="ipc"), "ipc"),
    (ranks((0, GPU_A, 0, 0, False, True), (0, GPU_A, 0, 0, False, True), setting="staged"), "staged"),
    (ranks((0, GPU_A, 0, 0, False, True), (2, GPU_A, 0, 0, False, True), setting="mpi"), "mpi"),
    (ranks((0, GPU_A, 0, 0, True, True), (0, GPU_A, 0, 0, True, True), setting="none"), "none"),   # the baseline
    # a device the transports have not run on yet (a real GPU today): auto keeps today's path, a setting takes them
    ([Placement(0, GPU_A, proven=False), Placement(0, GPU_A, proven=False)], "none"),
    ([Placement(0, GPU_A, setting="ipc", proven=False), Placement(0, GPU_A, setting="ipc", proven=False)], "ipc"),
    ([Placement(0, GPU_A, 0, 0, False, True, proven=False), Placement(2, GPU_B, 0, 0, False, True, proven=False)],
     "none"),
    # NCCL: auto takes it where ipc cannot serve and every rank has it, before a CUDA-aware MPI and staging
    (ranks((0, GPU_A, 0, 0, NCCL, False), (2, GPU_B, 0, 0, NCCL, False)), "nccl"),            # two nodes
    (ranks((0, GPU_A, 0, 0, NCCL, True), (2, GPU_B, 0, 0, NCCL, True)), "nccl"),              # ... CUDA-aware too
    (ranks((0, GPU_A, 0, 0, NCCL, False), (0, GPU_B, 1, 0, NCCL, False)), "nccl"),            # no peer access
    (ranks((0, GPU_A, 0, 0b10, NCCL, False), (0, GPU_B, 1, 0b01, NCCL, False)), "ipc"),       # peers: ipc first
    (ranks((0, GPU_A, 0, 0, NCCL, False), (0, GPU_A, 0, 0, NCCL, False)), "ipc"),             # one GPU: ipc leader
    (ranks((0, GPU_A, 0, 0, NCCL, False), (0, 0, 0, 0, NCCL, False)), "staged"),              # a rank without one
    (ranks((0, GPU_A, 0, 0, NCCL, False), (2, GPU_B, 0, 0, 0, False)), "staged"),             # a rank lacks NCCL
    (ranks((0, GPU_A, 0, 0, NCCL, True), (2, GPU_B, 0, 0, 0, True)), "mpi"),
    # two ranks share GPU_A on node 0, a third is on node 2: never nccl by auto, even where NCCL allows sharing
    (ranks((0, GPU_A, 0, 0, NCCL, False), (0, GPU_A, 0, 0, NCCL, False), (2, GPU_B, 0, 0, NCCL, False)), "staged"),
    (ranks((0, GPU_A, 0, 0, 23000, False), (0, GPU_A, 0, 0, 23000, False), (2, GPU_B, 0, 0, 23000, False)),
     "staged"),
    (ranks((0, GPU_A, 0, 0, NCCL, False), (2, GPU_B, 0, 0, NCCL, False), setting="nccl"), "nccl"),
    (ranks((0, GPU_A, 0, 0b10, NCCL, False), (0, GPU_B, 1, 0b01, NCCL, False), setting="nccl"), "nccl"),
    (ranks((0, GPU_A, 0, 0, 23000, False), (0, GPU_A, 0, 0, 23104, False), setting="nccl"), "nccl"),  # 2.30
    ([Placement(0, GPU_A, nccl=NCCL, proven=False), Placement(2, GPU_B, nccl=NCCL, proven=False)], "none"),
    ([Placement(0, GPU_A, nccl=NCCL, setting="nccl", proven=False),
      Placement(2, GPU_B, nccl=NCCL, setting="nccl", proven=False)], "nccl"),
    # hierarchical: across nodes, on the opt-in (HOROVOD_HIERARCHICAL_ALLREDUCE's) or where NCCL has no network
    (two_by_two(), "nccl"),
    (two_by_two(hierarchical=True), "hierarchical"),
    (two_by_two(nccl_net=False), "hierarchical"),
    (two_by_two(setting="hierarchical"), "hierarchical"),
    (two_by_two(0, nccl_net=False), "staged"),                                                 # no NCCL at all
    (two_by_two(nccl_net=False)[:3], "staged"),                                                # nodes of 2 and 1
    (ranks((0, GPU_A, 0, 0, NCCL, True), (0, GPU_A, 0, 0, NCCL, True), (2, GPU_B, 0, 0, NCCL, True),
           (2, GPU_B, 0, 0, NCCL, True), nccl_net=False), "mpi"),                              # devices shared
    (ranks((0, GPU_A, 0, 0b10, NCCL, False), (0, GPU_B, 1, 0b01, NCCL, False), nccl_net=False), "ipc"),  # one node
    (ranks((0, GPU_A, 0, 0, NCCL, False), (0, GPU_B, 1, 0, NCCL, False), hierarchical=True), "nccl"),  # one node
    (ranks((0, GPU_A, 0, 0, NCCL, False), (0, GPU_B, 1, 0, NCCL, False), setting="hierarchical"), "hierarchical"),
    (two_by_two(hierarchical=True, proven=False), "none"),                                     # a real GPU today
    (two_by_two(setting="hierarchical", proven=False), "hierarchical"),
])
def test_placements_map_to_a_transport(placements, expected):
    assert choose(placements)[0] == expected


@pytest.mark.parametrize("placements, words", [
    (ranks((0, GPU_A, 0, 0, False, False), (2, GPU_B, 0, 0, False, False), setting="ipc"), "span 2 nodes"),
    (ranks((0, GPU_A, 0, 0, False, False), (0, GPU_B, 1, 0, False, False), setting="ipc"),
     "rank 0's device cannot reach rank 1's"),
    (ranks((0, GPU_A, 0, 0, False, False), (0, 0, 0, 0, False, False), setting="ipc"), "ranks [1] have no device"),
    (ranks((0, GPU_A, 0, 0, False, True), (0, GPU_A, 0, 0, False, False), setting="mpi"),
     "ranks [1] is not CUDA-aware"),
    (ranks((0, GPU_A, 0, 0, NCCL, False), (2, GPU_B, 0, 0, 0, False), setting="nccl"), "ranks [1] have no NCCL"),
    (ranks((0, GPU_A, 0, 0, NCCL, False), (2, 0, 0, 0, NCCL, False), setting="nccl"), "ranks [1] have no device"),
    (ranks((0, GPU_A, 0, 0, NCCL, False), (0, GPU_A, 0, 0, NCCL, False), setting="nccl"),
     "ranks [0, 1] share one device, which NCCL before 2.30 refuses (\"Duplicate GPU detected\"); use auto or ipc"),
    (ranks((0, GPU_A, 0, 0, 23000, False), (0, GPU_A, 0, 0, NCCL, False), setting="nccl"), "share one device"),
    (ranks((0, GPU_A, 0, 0, NCCL, False), (2, GPU_B, 0, 0, NCCL, False), (2, GPU_B, 0, 0, NCCL, False),
           setting="nccl"), "ranks [1, 2] share one device"),
    (ranks((0, GPU_A, 0, 0, False, False)) + ranks((0, GPU_A, 0, 0, False, False), setting="ipc"),
     "ranks [0]: auto; ranks [1]: ipc"),
    (two_by_two(setting="nccl", nccl_net=False), "the ranks span 2 nodes and NCCL has no network between them on "
                                                 "ranks [0, 1, 2, 3] (DISTLAB_NCCL_NET=0); use hierarchical"),
    (two_by_two(setting="hierarchical")[:3],
     "every node must hold as many ranks, and they differ: node 0: ranks [0, 1]; node 2: ranks [2]"),
    (two_by_two(setting="hierarchical")[:2] + two_by_two(0, setting="hierarchical")[2:], "ranks [2, 3] have no NCCL"),
    (ranks((0, GPU_A, 0, 0, NCCL, False), (0, GPU_A, 0, 0, NCCL, False), (2, GPU_B, 0, 0, NCCL, False),
           (2, GPU_B, 0, 0, NCCL, False), setting="hierarchical"), "ranks [0, 1], [2, 3] share one device"),
    (two_by_two(setting="hierarchical")[:3] + ranks((2, 0, 0, 0, NCCL, False), setting="hierarchical"),
     "ranks [3] have no device"),
])
def test_a_transport_the_placement_cannot_serve_is_refused_naming_ranks(placements, words):
    with pytest.raises(ValueError, match="DISTLAB_DEVICE_COMM") as caught:
        choose(placements)
    assert words in str(caught.value)


def test_ranks_must_agree_on_the_hierarchical_opt_in():
    placements = two_by_two()[:1] + two_by_two(hierarchical=True)[1:]
    with pytest.raises(ValueError, match=r"DISTLAB_HIERARCHICAL_ALLREDUCE differs between ranks \(ranks \[1, 2, 3\] "
                                         r"set it, the others not\); every rank must set the same"):
        choose(placements)


def test_placements_travel_as_rows_and_one_device_means_one_reducer():
    for placement in (Placement(4, GPU_A, 1, 0b101, True, False, "staged"), Placement(0, GPU_A, proven=False),
                      Placement(2, GPU_B, 0, 0, NCCL, False, "nccl"),
                      Placement(2, GPU_B, 1, 0b1, NCCL, False, "hierarchical", nccl_net=False, hierarchical=True)):
        assert Placement.from_row(placement.row()) == placement
    assert reducer_mode(ranks((0, GPU_A, 0, 0, 0, 0), (0, GPU_A, 0, 0, 0, 0))) == "leader"
    assert reducer_mode(ranks((0, GPU_A, 0, 2, 0, 0), (0, GPU_B, 1, 1, 0, 0))) == "split"


def test_the_stand_ins_placement_carries_its_nccl_version():
    from distlab import fakegpu
    from distlab.comm.transports import local_placement
    from distlab.comm.transports.nccl import nccl_module

    placement = local_placement(0, "auto")
    assert placement.device and placement.proven and placement.nccl == fakegpu.cuda.nccl.get_version() == 22809
    assert nccl_module(fakegpu) is fakegpu.cuda.nccl and nccl_module(None) is None


def test_the_staged_pipeline_queues_every_chunk_down_before_the_host_waits(monkeypatch):
    """cupy's ``ndarray.get(stream=..., out=...)`` waits until its copy landed unless ``blocking=False``: the
    pipeline's copies down must not wait, or chunk k + 1 cannot come down while MPI moves chunk k (each chunk's
    event says when it landed)."""
    from distlab import comm, fakegpu
    from distlab.comm.transports import staged

    blocking, real = [], fakegpu.ndarray.get

    def get(self, *args, **kwargs):
        blocking.append(kwargs.get("blocking", True))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(staged, "CHUNK_BYTES", 64)
    monkeypatch.setattr(fakegpu.ndarray, "get", get)
    monkeypatch.setenv("DISTLAB_DEVICE_COMM", "staged")
    fakegpu.use_as_cuda()
    try:
        group = comm.ProcessGroup(name="staged-pipeline", timeout=30)
        assert group.device_comm == "staged"
        x = fakegpu.asarray(np.arange(100, dtype=np.float32))
        group.allreduce(x)
    finally:
        fakegpu.use_as_cuda(False)
    assert blocking == [False] * 7 and x.get().tolist() == list(range(100))  # 400 bytes in chunks of 64
