"""The prepared device check (``make gpu-check``): everything distlab can prove on a real GPU, in one command.

For a fresh machine with a CUDA GPU, cupy, a C++ compiler, Python with numpy, Cython, setuptools, mpi4py and
pytest, and no network (see docs/gpu.md). It makes a virtual environment that sees the machine's packages, puts
the carried ``mpich`` wheel in it (the machine has no MPI), builds the core in parallel, runs the GPU tests
(marker ``gpu`` in ``tests/test_*gpu*.py``, 2 ranks sharing the GPU) and the GPU benchmark's quick mode, and writes under the results
directory: ``gpu-check.log`` (every command and its output), ``gpu-check.json`` (each step: command, exit status,
seconds), ``gpu-tests.xml`` and ``gpu-examples.xml`` (pytest's JUnit reports), ``bench_gpu.json``, ``nccl.json`` (the NCCL version, and
whether a one-rank NCCL communicator reduced on the GPU, raw and through distlab's nccl transport; ``"absent"``
when cupy has no NCCL, which does not fail the check) and ``ddp_timeline.json`` (a Chrome trace of a few DDP
steps per device transport: the reducer's buckets against backward).

Run from the repository root: ``python3 scripts/gpu_check.py`` (``--dry-run`` prints the plan and runs nothing).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import site
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
#: How to fetch the wheel on a machine with a network (the device machine has none): it is carried in --wheels.
PIP_DOWNLOAD = ("python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 "
                "--platform manylinux_2_28_x86_64 -d wheels mpich==5.0.2")
#: The five examples with --device cuda against the CPU: a step of their own, bounded apart from the GPU tests.
EXAMPLE_TESTS = "test_gpu_examples.py"
#: Imported in the venv before anything runs: what the machine must provide (the venv sees its site-packages).
NEEDED = ("numpy", "Cython", "setuptools", "mpi4py", "pytest", "cloudpickle", "tqdm", "cupy")

FINDER = '''"""Written by scripts/gpu_check.py: distlab from the repository, as an editable install maps it."""
import importlib.abc
import importlib.util
import sys

MAPPING = {mapping!r}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in MAPPING:
            init = MAPPING[fullname] + "/__init__.py"
            return importlib.util.spec_from_file_location(fullname, init,
                                                          submodule_search_locations=[MAPPING[fullname]])
        return None


sys.meta_path.insert(0, _Finder())
'''


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=".venv-gpu", help="the virtual environment to create or reuse")
    parser.add_argument("--wheels", default="wheels", help="the carried wheels (mpich-*.whl)")
    parser.add_argument("--results", default="benchmarks/results/gpu-check", help="where the log and JSON go")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs (nproc)")
    parser.add_argument("--python", default=sys.executable, help="the machine's Python (with cupy and numpy)")
    parser.add_argument("--timeout", type=float, default=270.0, help="seconds for the tests and benchmark steps")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    parser.add_argument("--rehearse", action="store_true",
                        help="on a machine without a GPU: every step with the stand-in (distlab.fakegpu) instead of "
                             "cupy (the gpu tests then skip, the benchmark runs --device fake)")
    parser.add_argument("--nccl-check", metavar="JSON", help=argparse.SUPPRESS)  # the nccl step, run in the venv
    return parser.parse_args(argv)


def nccl_check(out: Path, rehearse: bool) -> int:
    """The nccl step: NCCL's version, then a one-rank communicator's allreduce on the device (any NCCL makes one,
    even where two ranks could not share the GPU), raw and through distlab's nccl transport; ``nccl.json`` says
    ``"absent"`` (exit status 0) when the device module has no NCCL."""
    if rehearse:
        from distlab import fakegpu as xp
    else:
        import cupy as xp
    from distlab.comm.transports.nccl import nccl_module

    nccl = nccl_module(xp)
    if nccl is None:
        record = {"nccl": "absent", "why": "cupy.cuda.nccl did not load libnccl (install nvidia-nccl-cu12 or -cu13)"}
        out.write_text(json.dumps(record, indent=2) + "\n")
        print("NCCL: absent;", record["why"])
        return 0
    code = int(nccl.get_version())
    record = {"nccl": code, "version": f"{code // 10000}.{code // 100 % 100}.{code % 100}", "module": xp.__name__}
    print(f"NCCL {record['version']} ({code}) through {xp.__name__}")
    try:
        communicator = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
        values = xp.arange(1 << 20, dtype=xp.float32)
        stream = xp.cuda.Stream(non_blocking=True)
        communicator.allReduce(values.data.ptr, values.data.ptr, values.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                               stream.ptr)
        stream.synchronize()
        communicator.destroy()
        record["raw_allreduce"] = "ok" if float(values[12345]) == 12345.0 else "wrong result"
        from distlab import comm
        from distlab.comm.transports import DEVICE_COMM_VAR

        os.environ[DEVICE_COMM_VAR] = "nccl"

        with comm.ProcessGroup(name="nccl-check", timeout=60) as group:
            averaged = xp.full(1000, 3.0, dtype=xp.float32)
            group.allreduce(averaged, op="avg")
            ok = group.device_comm == "nccl" and bool((averaged == 3.0).all())
        record["transport_allreduce"] = "ok" if ok else f"wrong result on {group.device_comm}"
    except Exception as exc:  # noqa: BLE001 - recorded, and the step fails
        record["error"] = f"{type(exc).__name__}: {exc}"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))
    return 0 if record.get("raw_allreduce") == record.get("transport_allreduce") == "ok" else 1


def machine_site_packages(python: str) -> list:
    """The site-packages of ``python`` (the machine's packages, which the venv is made to see)."""
    if python == sys.executable:
        return [p for p in site.getsitepackages() + [sysconfig.get_paths()["purelib"]] if os.path.isdir(p)]
    out = subprocess.run([python, "-c", "import site, sysconfig; print('\\n'.join(site.getsitepackages() + "
                          "[sysconfig.get_paths()['purelib']]))"], capture_output=True, text=True, check=True)
    return [p for p in out.stdout.split() if os.path.isdir(p)]


def venv_site_packages(venv: Path, python: str) -> Path:
    version = subprocess.run([python, "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
                             capture_output=True, text=True, check=True).stdout.strip() \
        if python != sys.executable else f"{sys.version_info[0]}.{sys.version_info[1]}"
    return venv / "lib" / f"python{version}" / "site-packages"


def plan(args) -> list:
    """The steps: ``(name, argv or a callable, timeout or None)``; callables write files (shown by name)."""
    venv = (REPO / args.venv).resolve()
    vpy = venv / "bin" / "python"
    results = (REPO / args.results).resolve()
    steps = []
    if not vpy.exists():
        steps.append(("venv", [args.python, "-m", "venv", "--without-pip", str(venv)], None))
    steps.append(("see the machine's packages", lambda: write_paths(args, venv), None))
    if not (venv / "bin" / "mpiexec").exists():
        wheels = sorted(glob.glob(str(REPO / args.wheels / "mpich-*.whl")))
        wheel = wheels[-1] if wheels else str(REPO / args.wheels / "mpich-*.whl")
        steps.append(("mpich", [args.python, "-m", "pip", "install", "--no-index", "--no-deps", "--ignore-installed", "--prefix",
                                str(venv), wheel], None))
    steps.append(("preflight", [str(vpy), "-P", "-c", PREFLIGHT, *(["rehearse"] if args.rehearse else [])], None))
    steps.append(("build the core", [str(vpy), "setup.py", "-q", "build_ext", "--inplace", "-j", str(args.jobs)],
                  None))
    steps.append(("nccl", [str(vpy), "-P", str(REPO / "scripts" / "gpu_check.py"), "--nccl-check",
                           str(results / "nccl.json"), *(["--rehearse"] if args.rehearse else [])], 120.0))
    env_tests = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_*gpu*.py")
                       if p.name != EXAMPLE_TESTS)
    steps.append(("gpu tests", [str(vpy), "-P", "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                f"--junitxml={results / 'gpu-tests.xml'}", *env_tests], args.timeout))
    steps.append(("gpu examples", [str(vpy), "-P", "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                                   f"--junitxml={results / 'gpu-examples.xml'}", f"tests/{EXAMPLE_TESTS}"],
                  args.timeout))
    steps.append(("bench_gpu --quick", [str(vpy), "-P", "benchmarks/bench_gpu.py", "--quick", "--json",
                                        str(results / "bench_gpu.json"), "--timeline",
                                        str(results / "ddp_timeline.json"),
                                        *(["--device", "fake"] if args.rehearse else [])], args.timeout))
    return steps


#: Run in the venv: what the machine must provide, said clearly before anything is built.
PREFLIGHT = f"""
import importlib, shutil, sys
missing = []
rehearse = sys.argv[1:] == ["rehearse"]
for name in {NEEDED!r}[:-1] if rehearse else {NEEDED!r}:
    try:
        importlib.import_module(name)
    except Exception as exc:
        missing.append(f"{{name}} ({{type(exc).__name__}}: {{exc}})")
if not (shutil.which("c++") or shutil.which("g++")):
    missing.append("a C++ compiler (c++ or g++)")
if missing:
    sys.exit("gpu-check: the machine lacks " + "; ".join(missing))
from mpi4py import MPI
print("MPI:", MPI.Get_library_version().splitlines()[0])
if rehearse:
    sys.exit(print("rehearsal: no GPU needed (the stand-in runs the benchmark)"))
import cupy
n = cupy.cuda.runtime.getDeviceCount()
if n < 1:
    sys.exit("gpu-check: cupy sees no CUDA device")
name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
name = name.decode() if isinstance(name, bytes) else name
print(f"python {{sys.version.split()[0]}}, cupy {{cupy.__version__}}, {{n}} device(s): {{name}}")
"""


def write_paths(args, venv: Path) -> str:
    """A .pth naming the machine's site-packages, and the finder that maps distlab to this repository."""
    target = venv_site_packages(venv, args.python)
    target.mkdir(parents=True, exist_ok=True)
    (target / "_machine_site_packages.pth").write_text("\n".join(machine_site_packages(args.python)) + "\n")
    mapping = {"distlab": str(REPO / "src" / "distlab"), "distlab.core": str(REPO / "core"),
               "distlab.reference": str(REPO / "reference")}
    (target / "_distlab_repo_finder.py").write_text(FINDER.format(mapping=mapping))
    (target / "_distlab_repo.pth").write_text("import _distlab_repo_finder\n")
    return f"wrote {target}/_machine_site_packages.pth, _distlab_repo.pth"


def describe(step) -> str:
    name, what, timeout = step
    shown = (" ".join("<the preflight script>" if a == PREFLIGHT else a for a in what) if isinstance(what, list)
             else "(writes the venv's .pth files and distlab's finder)")
    return f"[{name}] {shown}" + (f"  (timeout {timeout:g} s)" if timeout else "")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.nccl_check:
        return nccl_check(Path(args.nccl_check), args.rehearse)
    steps = plan(args)
    if args.dry_run:
        print("gpu-check plan (dry run):")
        for step in steps:
            print("  " + describe(step))
        return 0
    if any(s[0] == "mpich" for s in steps) and not glob.glob(str(REPO / args.wheels / "mpich-*.whl")):
        print(f"gpu-check: no MPI in the venv and no mpich wheel in {args.wheels}/: on a machine with a network, "
              f"run\n    {PIP_DOWNLOAD}\nand carry {args.wheels}/ with the repository", file=sys.stderr)
        return 2
    results = (REPO / args.results).resolve()
    results.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PATH=f"{(REPO / args.venv).resolve() / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    report = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "steps": []}
    status = 0
    with open(results / "gpu-check.log", "w") as log:
        for step in steps:
            name, what, timeout = step
            line = describe(step)
            print(line, flush=True)
            log.write(line + "\n")
            start = time.monotonic()
            if callable(what):
                rc, output = 0, what() + "\n"
            else:
                try:
                    done = subprocess.run(what, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True, timeout=timeout)
                    rc, output = done.returncode, done.stdout
                except subprocess.TimeoutExpired as exc:
                    partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout
                    rc, output = 124, (partial or "") + f"\ngpu-check: [{name}] ran past {timeout:g} s\n"
            seconds = time.monotonic() - start
            sys.stdout.write(output)
            log.write(output)
            log.write(f"[{name}] exit status {rc} after {seconds:.1f} s\n")
            print(f"[{name}] exit status {rc} after {seconds:.1f} s", flush=True)
            report["steps"].append({"name": name, "command": line, "rc": rc, "seconds": round(seconds, 1)})
            if rc:
                status = rc
                if name in ("venv", "mpich", "preflight", "build the core"):
                    break  # nothing after it can run
    report["passed"] = status == 0
    (results / "gpu-check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"gpu-check: {'passed' if status == 0 else 'FAILED'}; log and JSON in {results}", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
