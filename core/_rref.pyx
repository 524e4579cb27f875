# cython: language_level=3
# distutils: language = c++
"""Core twin of :mod:`distlab.reference.rref` (:mod:`~distlab.reference.rref_impl`, then
:mod:`~distlab.reference.rref_context`): same names, same order; read those. Laid out like them, file for file:
``_rref_impl.pxi`` and ``_rref_context.pxi`` are included below, after the C declarations they share.

An id is one ``int64_t`` here (``created_on << LOCAL_BITS | local_id``, one-to-one because both parts are
range-checked first), the owner's fork counts are C++ sets of those keys, and a UserRRef's protocol state is C
fields. Errors, string forms and the shutdown report come from ``distlab._common.rref``, shared with the reference.
"""
import threading

from cpython.long cimport PyLong_AsLongLongAndOverflow
from libc.stdint cimport int64_t
from libcpp.unordered_map cimport unordered_map
from libcpp.unordered_set cimport unordered_set
from libcpp.vector cimport vector
from libcpp.algorithm cimport sort as cpp_sort
from cython.operator cimport dereference as deref, preincrement as inc

from distlab._common import rref as _shared
from distlab._common.rref import (UNSET, confirmation_description, control_failed, creation_timeout_error,
                                  deleted_error, duplicate_child, duplicate_user, id_overflow, malformed_control,
                                  malformed_fork_data, malformed_id, pending_owner_description, value_description)
from distlab._wire import RFD_TUPLE_SIZE, RREF_LOCAL_ID_BITS, RREF_WORKER_ID_BITS
from distlab.errors import DistTimeoutError
from distlab.futures import Future

__all__ = ["GloballyUniqueId", "RRefForkData", "OwnerRRef", "UserRRef", "RRefContext", "parse_fork_data"]

cdef enum:
    LOCAL_BITS = 40
    WORKER_BITS = 16
    K_USER_DELETE = 4
    K_FORK_REQUEST = 5
    K_CHILD_ACCEPT = 6

# The C constants above must be the shared ones (they travel between ranks).
assert (LOCAL_BITS, WORKER_BITS) == (RREF_LOCAL_ID_BITS, RREF_WORKER_ID_BITS)
cdef Py_ssize_t FORK_DATA_LEN = RFD_TUPLE_SIZE  # read from the shared layout, not written here
assert (K_USER_DELETE, K_FORK_REQUEST, K_CHILD_ACCEPT) == (
    _shared.K_USER_DELETE, _shared.K_FORK_REQUEST, _shared.K_CHILD_ACCEPT)

cdef int64_t LOCAL_LIMIT = (<int64_t>1) << LOCAL_BITS
cdef int64_t LOCAL_MASK = LOCAL_LIMIT - 1
cdef int64_t WORKER_LIMIT = (<int64_t>1) << WORKER_BITS
assert (LOCAL_LIMIT, WORKER_LIMIT) == (_shared.LOCAL_ID_LIMIT, _shared.WORKER_ID_LIMIT)

ctypedef unordered_map[int64_t, unordered_set[int64_t]] ForkTable

include "_rref_impl.pxi"
include "_rref_context.pxi"
