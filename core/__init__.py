"""distlab.core: the compiled Cython twin (what runs by default); docstrings point to ``distlab.reference``.

The modules are loaded one by one through :func:`distlab._backend.load` when a facade first needs them;
``import distlab`` only checks that they are compiled (:func:`distlab._backend.check_core_built`).
"""
