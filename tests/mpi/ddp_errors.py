"""DDP refuses models and arguments that differ across ranks, on every rank, naming the rank and the parameter
or argument; a compression hook's timeout names the rank that never reached backward. On numpy, then on the device
stand-in, in one launch."""
import sys

import numpy as np

import distlab
from distlab import comm, nn
from distlab.ddp import DistributedDataParallel as DDP
from distlab.ddp_comm_hooks import bf16_compress_hook, fp16_compress_hook
from distlab.errors import DistTimeoutError
from scenario_checks import DEVICES, host, on, staged_outside_comm, start_counting, to_device

impl = sys.argv[1]
pg = comm.world()
last = pg.size - 1

for device in DEVICES:  # numpy, then the strict device stand-in, in one launch
    start_counting(device)
    # A different parameter count on the last rank.
    layers = [nn.Linear(4, 4), nn.Linear(4, 2)] + ([nn.Linear(2, 2)] if pg.rank == last else [])
    try:
        DDP(to_device(nn.Sequential(*layers), device), impl=impl)
        raise AssertionError("a model with more parameters on one rank must be refused")
    except ValueError as exc:
        assert f"rank {last} has 6 parameters that require grad while rank 0 has 4" in str(exc), str(exc)

    # A different shape on the last rank.
    width = 5 if pg.rank == last else 4
    try:
        DDP(to_device(nn.Sequential(nn.Linear(3, width)), device), impl=impl)
        raise AssertionError("a model with another shape on one rank must be refused")
    except ValueError as exc:
        theirs = width if pg.rank == last else 5
        assert f"parameter '0.weight' is float32[{theirs}, 3] on rank {last}" in str(exc), str(exc)

    # Different arguments on the last rank: refused at construction, not left to time out in a later collective
    # ("auto" probes the link at the rebuild where a fixed cap does not; an unused-parameter map is reduced or not).
    for theirs, mine, text in [
        (dict(bucket_cap_mb=25), {}, f"bucket_cap_mb=25 on rank {last} but 'auto' on rank 0"),
        (dict(find_unused_parameters=True, broadcast_buffers=False), {},
         f"find_unused_parameters=True on rank {last} but False on rank 0; broadcast_buffers=False on rank {last} "
         "but True on rank 0"),
        (dict(reduce_dtype=np.float16), dict(reduce_dtype=np.float32),
         f"reduce_dtype='float16' on rank {last} but 'float32' on rank 0"),
    ]:
        try:
            DDP(to_device(nn.Linear(3, 3), device), impl=impl, **(theirs if pg.rank == last else mine))
            raise AssertionError(f"{theirs} on one rank only must be refused")
        except ValueError as exc:
            assert str(exc) == f"DistributedDataParallel expects the same arguments on every rank: {text}", str(exc)

    # Parameters start equal everywhere: rank 0's initialisation is broadcast.
    distlab.manual_seed(pg.rank)  # deliberately different initialisation per rank
    model = DDP(to_device(nn.Linear(3, 3), device), impl=impl)
    gathered = pg.allgather(model.module.weight.data)
    assert all(np.array_equal(host(gathered[0]), host(g)) for g in gathered), \
        "parameters must be synchronised from rank 0"

    # A rank that never reaches backward, under the hooks that chain the allreduce's future with then() (fp16/bf16
    # compression): backward's wait names the missing rank (then() used to report "... is not completed yet").
    # (each hook waits out its timeout: the stand-in runs one of them)
    for hook in (fp16_compress_hook, bf16_compress_hook) if device == "cpu" else (bf16_compress_hook,):
        group = comm.ProcessGroup(name=hook.__name__, timeout=1.0)
        model = DDP(to_device(nn.Linear(3, 1), device), process_group=group, impl=impl)
        model.register_comm_hook(group, hook)
        if pg.rank != last:
            try:
                model(distlab.tensor(on(device, np.ones((2, 3), np.float32)))).sum().backward()
                raise AssertionError(f"{hook.__name__}: backward without rank {last} must time out")
            except DistTimeoutError as exc:
                assert exc.missing_ranks == [last] and f"ranks [{last}] have not entered it" in str(exc), exc
        pg.barrier()
    assert not staged_outside_comm(device), staged_outside_comm(device)
    print(f"rank {pg.rank}: model checks on {device} OK", flush=True)
print(f"rank {pg.rank}: model checks OK", flush=True)
