"""Build distlab: the facade in src/distlab, the reference twin in reference/, the Cython core twin in core/.

Cython extensions are named explicitly (globbing infers wrong module names under a package_dir mapping).
The core modules are read from the registry of twins, src/distlab/_twins.py (executed as a file: distlab is not
importable before it is built); a core module's source is core/<stem>.pyx, with the .pxi files it includes.
"""
from pathlib import Path

import numpy
from setuptools import Extension, find_packages, setup
from Cython.Build import cythonize

_registry: dict = {}
exec((Path(__file__).resolve().parent / "src" / "distlab" / "_twins.py").read_text(encoding="utf-8"), _registry)
CORE_MODULES = [core for _files, _loaded, core in _registry["TWINS"].values()]

# numpy's headers: the reducer reads gradient arrays through numpy's C API (`cimport numpy`). Built against numpy
# 2.x, the extension runs with numpy 1.x and 2.x alike.
extensions = [Extension(f"distlab.core.{stem}", [f"core/{stem}.pyx"], include_dirs=[numpy.get_include()],
                        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
                        extra_compile_args=["-Wall"])
              for stem in CORE_MODULES]

setup(
    package_dir={"": "src", "distlab.reference": "reference", "distlab.core": "core"},
    # every package under src/ (found, not listed: a new subpackage cannot be forgotten), plus the two twins
    packages=find_packages("src") + ["distlab.reference", "distlab.core"],
    package_data={"distlab.core": ["*.pyx", "*.pxi", "*.pxd", "*.pyi"]},
    ext_modules=cythonize(
        extensions,
        # Module-wide directives only; boundscheck/wraparound/cdivision are set per hot function in core/.
        compiler_directives={
            "language_level": 3,
            "binding": True,
            "embedsignature": True,
        },
    ),
    zip_safe=False,
)
