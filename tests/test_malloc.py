"""glibc keeps freed memory for the next step when a program asks (``distlab.keep_freed_memory()`` or
``DISTLAB_MALLOC=keep``), never because distlab was imported (``distlab._malloc``).

Each case runs in a fresh interpreter: malloc's thresholds are process state, and glibc adjusts them by itself
after some frees, so only a new process shows what was done.
"""
import os
import subprocess
import sys

import pytest

from distlab._malloc import is_glibc

glibc = pytest.mark.skipif(not is_glibc(), reason="the thresholds are glibc's")

# A step's allocations in the two size classes that matter: 32 KiB arrays (a forward's saved activations, freed
# together at the heap's top) and 256 KiB arrays (gradients, above glibc's default mmap threshold of 128 KiB).
CHURN = """
import resource, sys
import numpy as np
import distlab
import distlab._malloc
if sys.argv[1:] == ["call"]:
    distlab.keep_freed_memory()

def step():
    saved = [np.ones(8192, np.float32) for _ in range(100)]
    grads = [np.ones(65536, np.float32) for _ in range(20)]
    del saved, grads

step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(distlab._malloc.STATE, (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 5)
"""


def run(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items()
                   if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "DISTLAB_MALLOC")}
    return subprocess.run([sys.executable, "-c", code, *args], env={**environment, **env}, capture_output=True,
                          text=True, timeout=120)


def churn(*args: str, **env: str) -> tuple[str, int]:
    done = run(CHURN, *args, **env)
    assert done.returncode == 0, done.stderr
    state, faults = done.stdout.split()
    return state, int(faults)


@glibc
def test_importing_distlab_leaves_malloc_alone_and_every_step_faults_its_pages_again():
    state, faults = churn()
    assert state == "default"
    assert faults > 1000  # 2,080 pages are written per step


@glibc
@pytest.mark.parametrize("how", ["call", "environment"])
def test_a_program_that_asks_keeps_freed_memory_so_a_repeated_step_faults_no_pages(how):
    state, faults = churn("call") if how == "call" else churn(DISTLAB_MALLOC="keep")
    assert state == "keep"
    assert faults < 100


@glibc
def test_distlab_malloc_system_makes_the_call_leave_glibcs_defaults():
    state, faults = churn("call", DISTLAB_MALLOC="system")
    assert state == "system"
    assert faults > 1000


@glibc
@pytest.mark.parametrize("knob", [{"MALLOC_TRIM_THRESHOLD_": "131072"},
                                  {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}])
def test_the_users_own_glibc_settings_win(knob):
    state, faults = churn("call", **knob)
    assert state == "user"
    assert faults > 1000  # the user's 128 KiB trim threshold stands


def test_an_unknown_distlab_malloc_value_is_refused_at_import():
    done = run("import distlab", DISTLAB_MALLOC="always")
    assert done.returncode != 0
    assert "DISTLAB_MALLOC='always' is not one of keep, system" in done.stderr
