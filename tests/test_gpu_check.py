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
    steps = [line.split("]")[0].strip(" [") for line in plan.splitlines()[1:] if line.startswith("  [")]
    assert steps == ["venv", "see the machine's packages", "mpich", "preflight", "build the core", "nccl",
                     "gpu tests", "bench_gpu --quick"]
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
def test_bench_gpu_code_paths_on_the_stand_in(tmp_path):
    out = tmp_path / "bench_gpu.json"
    done = subprocess.run([sys.executable, "-P", str(REPO / "benchmarks" / "bench_gpu.py"), "--quick", "--device",
                           "fake", "--steps", "1", "--warmup", "0", "--json", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    assert [r["bytes"] for r in report["allreduce"]] == bench_gpu.QUICK_SIZES
    assert report["ddp_step"]["ddp_ms"] > 0 and report["local_step"]["distlab_ms"] > 0
    assert "1. one process" in done.stdout and "3. DDP step on 2 ranks" in done.stdout


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
