"""``make gpu-check`` and ``benchmarks/bench_gpu.py`` without a GPU: the plan (dry run), the refusals, the venv's
view of distlab, and the benchmark's code paths on the strict stand-in (its figures mean nothing)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
sys.path.insert(0, str(REPO / "benchmarks"))
import bench_gpu  # noqa: E402
import gpu_check  # noqa: E402

sys.path.remove(str(REPO / "scripts"))
sys.path.remove(str(REPO / "benchmarks"))


def test_the_plan_builds_in_parallel_and_runs_the_gpu_tests_and_the_quick_benchmark(tmp_path, capsys):
    assert gpu_check.main(["--dry-run", "--venv", str(tmp_path / "v"), "--jobs", "16"]) == 0
    plan = capsys.readouterr().out
    assert f"-m venv --without-pip {tmp_path / 'v'}" in plan
    assert "pip install --no-index --no-deps --ignore-installed --prefix" in plan and "mpich-" in plan
    assert "setup.py -q build_ext --inplace -j 16" in plan
    assert "-m pytest -q -m gpu" in plan and "tests/test_gpu.py" in plan and "tests/test_gpu_scenarios.py" in plan
    assert "benchmarks/bench_gpu.py --quick --json" in plan and "gpu-check/bench_gpu.json" in plan
    assert "--timeline" in plan and "gpu-check/ddp_timeline.json" in plan
    steps = [line.split("]")[0].strip(" [") for line in plan.splitlines()[1:] if line.startswith("  [")]
    assert steps == ["venv", "see the machine's packages", "mpich", "preflight", "build the core", "nccl",
                     "gpu tests", "gpu examples", "bench_gpu --quick"]
    tests_line = next(line for line in plan.splitlines() if line.startswith("  [gpu tests]"))
    examples_line = next(line for line in plan.splitlines() if line.startswith("  [gpu examples]"))
    assert "test_gpu_examples.py" not in tests_line and "tests/test_gpu_examples.py" in examples_line
    assert "gpu-check/gpu-examples.xml" in examples_line
    assert "gpu_check.py --nccl-check" in plan and "gpu-check/nccl.json" in plan


def test_the_rehearsal_plan_needs_no_gpu(tmp_path, capsys):
    assert gpu_check.main(["--dry-run", "--rehearse", "--venv", str(tmp_path / "v")]) == 0
    plan = capsys.readouterr().out
    assert "<the preflight script> rehearse" in plan and "bench_gpu.py --quick" in plan and "--device fake" in plan


def test_without_the_mpich_wheel_it_says_how_to_fetch_it(tmp_path, capsys):
    assert gpu_check.main(["--venv", str(tmp_path / "v"), "--wheels", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "no mpich wheel" in err and gpu_check.PIP_DOWNLOAD in err
    assert "pip download --no-deps --only-binary=:all: --python-version 3.12" in err
    assert not (tmp_path / "v").exists()  # refused before doing anything


def test_the_venv_sees_the_machines_packages_and_distlab_from_the_repository(tmp_path):
    args = gpu_check.parse_args(["--venv", str(tmp_path / "v")])
    gpu_check.write_paths(args, tmp_path / "v")
    site_dir = gpu_check.venv_site_packages(tmp_path / "v", args.python)
    assert (site_dir / "_machine_site_packages.pth").read_text().split() == gpu_check.machine_site_packages(
        args.python)
    code = ("import site, sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]; "
            f"site.addsitedir({str(site_dir)!r}); import distlab.core, distlab.reference, distlab.rpc; "
            "print(distlab.core.__path__[0], distlab.reference.__path__[0])")
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(REPO / "core"), str(REPO / "reference")]


def test_bench_gpu_refuses_clearly_without_a_gpu_and_checks_its_arguments(capsys):
    pytest.importorskip("numpy")
    if bench_gpu.gpu_or_reason()[0] is not None:
        pytest.skip("this machine has a GPU: make gpu-check runs the benchmark")
    assert bench_gpu.main(["--quick"]) == 2
    assert "bench_gpu: needs cupy and a CUDA device" in capsys.readouterr().err
    args = bench_gpu.parse_args(["--quick"])
    assert (args.steps, args.warmup, args.np) == (10, 3, 2)
    with pytest.raises(SystemExit):
        bench_gpu.parse_args(["--steps", "0"])


@pytest.mark.mpi
def test_bench_gpu_measures_every_transport_the_stand_in_allows_and_checks_every_result(tmp_path, monkeypatch):
    from distlab import fakegpu  # noqa: F401 - the stand-in is this process's device too, for its placement
    from distlab.comm.transports import choose, local_placement

    monkeypatch.setenv("DISTLAB_CUDA_AWARE", "0")  # as the benchmark's ranks get it: mpi is refused
    allowed = []
    for name in bench_gpu.transports():
        try:
            choose([local_placement(0, name)] * 2)  # 2 ranks on one node sharing the one stand-in device
            allowed.append(name)
        except ValueError:
            pass
    assert {"none", "ipc", "staged"} <= set(allowed) and "mpi" not in allowed
    out, trace = tmp_path / "bench_gpu.json", tmp_path / "ddp_timeline.json"
    done = subprocess.run([sys.executable, "-P", str(REPO / "benchmarks" / "bench_gpu.py"), "--quick", "--tiny",
                           "--device", "fake", "--steps", "2", "--warmup", "1", "--json", str(out), "--timeline",
                           str(trace)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert report["transports"]["ran"] == allowed and report["checks_passed"] and report["problems"] == []
    refused = {name: why for name, why in report["transports"]["skipped"].items() if name in bench_gpu.transports()}
    assert set(refused) == set(bench_gpu.transports()) - set(allowed)
    assert all("DISTLAB_DEVICE_COMM=" in why for why in refused.values()), refused  # refused, not failed
    table = report["allreduce"]
    assert table["columns"] == allowed + [bench_gpu.SHARED] + list(bench_gpu.LIMITS)  # ipc's, of a shared array
    assert [row["bytes"] for row in table["rows"]] == bench_gpu.TINY_SIZES[:2]
    for row in table["rows"]:
        assert all(row[column]["ok"] and row[column]["ms"] > 0 for column in table["columns"]), row
    table = report["ddp_step"]
    assert table["columns"] == ["floor"] + allowed and [row["model"] for row in table["rows"]] == ["small"]
    for row in table["rows"]:
        assert row["floor"]["ms"] > 0 and all(row[column]["ok"] and row[column]["x floor"] > 0 for column in allowed)
    assert report["machine"]["cpus"] >= 1 and "--tiny" in report["command"] and report["date"].endswith("Z")
    assert report["local_step"]["distlab_ms"] > 0
    for header in ("1. one process", "2. allreduce of float32 device arrays on 2 ranks", "| size | none | ipc |",
                   "3. DDP step on 2 ranks", "skipped mpi: DISTLAB_DEVICE_COMM=mpi"):
        assert header in done.stdout, done.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    spans = {e["name"] for e in events if e.get("ph") == "X"}
    assert {f"DDP step ({name})" for name in allowed} <= spans and "bucket 0 allreduce" in spans


def test_bench_gpu_keeps_the_other_columns_when_a_transport_fails_or_is_refused(monkeypatch):
    def launch(fn, args, np_, timeout, env=None):
        name = args[1]
        if name == "ipc":
            return "RankFailedError: rank 1 of 2 raised: boom"
        if name == "nccl":
            return [{"refused": "DISTLAB_DEVICE_COMM=nccl: no"}] * 2
        figure = [{"ms": 2.0, "ok": True}, {"ms": 3.0, "ok": name != "staged"}]  # rank 1 is the slowest
        return [{"allreduce": [figure[k]], "ddp": [figure[k]]} for k in range(2)]

    monkeypatch.setattr(bench_gpu, "_launch", launch)
    monkeypatch.setattr(bench_gpu, "transports", lambda: ["none", "ipc", "nccl", "staged"])
    args = bench_gpu.parse_args(["--device", "fake", "--quick"])
    allreduce, ddp, skipped, problems = [{"bytes": 3000}], [{"model": "small"}], {}, []
    ran = bench_gpu._transport_columns(args, (), allreduce, ddp, skipped, problems)
    assert ran == ["none", "staged"] and problems == ["ipc: RankFailedError: rank 1 of 2 raised: boom"]
    assert skipped == {"ipc": "failed: RankFailedError: rank 1 of 2 raised: boom",
                       "nccl": "DISTLAB_DEVICE_COMM=nccl: no"}
    assert allreduce[0]["none"] == {"ms": 3.0, "ok": True, "GB/s": 0.001} and ddp[0]["staged"] == {"ms": 3.0,
                                                                                                   "ok": False}


def test_the_nccl_step_records_the_version_and_a_one_rank_allreduce_or_absent(tmp_path, monkeypatch):
    """On the stand-in (its NCCL reduces with MPI): the version and both allreduces; without NCCL: "absent" and
    exit status 0, so a machine without NCCL does not fail the check."""
    out = tmp_path / "nccl.json"
    done = subprocess.run([sys.executable, "-P", str(REPO / "scripts" / "gpu_check.py"), "--nccl-check", str(out),
                           "--rehearse"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(out.read_text())
    assert record["nccl"] == 22809 and record["version"] == "2.28.9"
    assert record["raw_allreduce"] == record["transport_allreduce"] == "ok"
    from distlab import fakegpu

    monkeypatch.setattr(fakegpu.cuda.nccl, "available", False)
    assert gpu_check.nccl_check(out, rehearse=True) == 0
    assert json.loads(out.read_text())["nccl"] == "absent"
