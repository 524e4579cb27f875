"""The twin switch: DISTLAB_IMPL, distlab.IMPL, and no silent fallback when the core is missing."""
import os
import subprocess
import sys
import textwrap

import pytest

from distlab import _backend


def _python(code, **env):
    full = dict(os.environ)
    full.pop("DISTLAB_IMPL", None)
    full.update(env)
    return subprocess.run([sys.executable, "-P", "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full, timeout=60)


@pytest.mark.parametrize("value, expect", [(None, "core"), ("auto", "core"), ("core", "core"),
                                           ("reference", "reference"), ("REFERENCE", "reference")])
def test_impl_follows_the_environment(value, expect):
    env = {} if value is None else {"DISTLAB_IMPL": value}
    done = _python("import distlab; print(distlab.IMPL)", **env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == expect


def test_invalid_impl_is_refused():
    done = _python("import distlab", DISTLAB_IMPL="fast")
    assert done.returncode != 0 and "DISTLAB_IMPL='fast' is not one of auto, reference, core" in done.stderr


BLOCK_CORE = """
    import sys
    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.startswith("distlab.core._"):
                raise ImportError(f"No module named {name!r} (simulated: not compiled)")
    sys.meta_path.insert(0, Block())
"""


@pytest.mark.parametrize("value", ["auto", "core"])
def test_missing_core_is_an_import_error_with_a_build_hint(value):
    done = _python(textwrap.dedent(BLOCK_CORE) + "import distlab", DISTLAB_IMPL=value)
    assert done.returncode != 0
    assert "CoreNotBuiltError" in done.stderr and "make build" in done.stderr and "DISTLAB_IMPL=reference" in done.stderr


def test_missing_core_does_not_affect_the_reference_twin():
    done = _python(textwrap.dedent(BLOCK_CORE) + "import distlab; print(distlab.IMPL)", DISTLAB_IMPL="reference")
    assert done.returncode == 0 and done.stdout.strip() == "reference", done.stderr


def test_core_is_compiled_code():
    for component in _backend.COMPONENTS:
        module = _backend.load(component, "core")
        assert module.__file__.endswith((".so", ".pyd")), module.__file__


def test_load_rejects_unknown_names():
    with pytest.raises(KeyError, match="unknown twinned component"):
        _backend.load("nope")
    with pytest.raises(ValueError):
        _backend.load("fingerprint", "fast")
