"""distlab.core: the compiled Cython twin (what runs by default); docstrings point to ``distlab.reference``.

Importing this package checks that every core extension is compiled and fails with a build hint otherwise.
"""
from distlab import _backend as _b

for _component, (_reference_name, _core_name) in _b.COMPONENTS.items():
    _b.load(_component, "core")

del _b, _component, _reference_name, _core_name
