"""The launcher's per-rank environment and argv."""
import os
import sys

from mpi4py import MPI

world = MPI.COMM_WORLD
assert os.environ["RANK"] == str(world.rank)
assert os.environ["WORLD_SIZE"] == str(world.size)
assert os.environ["LOCAL_WORLD_SIZE"] == str(world.size)  # one machine
assert os.environ["LOCAL_RANK"] == str(world.rank)
assert sys.argv[1:] == ["alpha", "--beta", "3"], sys.argv
assert __name__ == "__main__"
print(f"rank {world.rank} env OK", flush=True)
