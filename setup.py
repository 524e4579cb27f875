"""Build distlab: the facade in src/distlab, the reference twin in reference/, the Cython core twin in core/.

Cython extensions are named explicitly (globbing infers wrong module names under a package_dir mapping).
To add a core module, add its stem to CORE_MODULES; its source is core/<stem>.pyx.
"""
import numpy
from setuptools import Extension, setup
from Cython.Build import cythonize

CORE_MODULES = [
    "_fingerprint",
    "_reducer",
    "_join",
    "_rref",
    "_autograd_container",
    "_negotiation",
]

# numpy's headers: the reducer reads gradient arrays through numpy's C API (`cimport numpy`). Built against numpy
# 2.x, the extension runs with numpy 1.x and 2.x alike.
extensions = [Extension(f"distlab.core.{stem}", [f"core/{stem}.pyx"], include_dirs=[numpy.get_include()],
                        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
                        extra_compile_args=["-Wall"])
              for stem in CORE_MODULES]

setup(
    package_dir={"": "src", "distlab.reference": "reference", "distlab.core": "core"},
    packages=[
        "distlab", "distlab.reference", "distlab.core",
        "distlab.autograd", "distlab.nn", "distlab.optim", "distlab.rpc", "distlab.viz",
    ],
    package_data={"distlab.core": ["*.pyx", "*.pxi", "*.pxd"]},
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
