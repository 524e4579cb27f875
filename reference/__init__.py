"""distlab.reference: the readable pure-Python twin of every twinned component (the textbook).

Each module here has a Cython twin in ``distlab.core`` with the same ``__all__`` and behaviour; the pairs are
registered in ``distlab._twins.TWINS``. Import components through the facade (``distlab.ddp``, ...) to
get the active twin, or from here to read or test the reference twin specifically.
"""
