"""What a restarted job's ranks see. argv: mode: "ok", "fail" (rank attempt % size raises in every attempt) or
"fail-once" (rank 1 raises in the first attempt only). Each rank prints its attempt and the restart variables."""
import os
import sys

mode = sys.argv[1]
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
attempt = int(os.environ["DISTLAB_RESTART_COUNT"])
run_dir = os.environ["DISTLAB_RUN_DIR"]
print(f"attempt {attempt} of at most {int(os.environ['DISTLAB_MAX_RESTARTS']) + 1}, run dir kept: "
      f"{os.path.isdir(run_dir)}", flush=True)
if mode == "fail" and rank == attempt % size:
    raise ValueError(f"attempt {attempt} fails")
if mode == "fail-once" and attempt == 0 and rank == 1:
    raise ValueError("the first attempt fails")
