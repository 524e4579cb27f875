# Included by _negotiation.pyx: core twin of distlab.reference.coordinator, rank 0's side of the slow path
# (validation, fusion, the response list), on C records per response.

cdef inline long long _size_bytes(Response response):
    """See :func:`distlab.reference.coordinator._size_bytes`."""
    if not response.tensor_sizes or not 0 <= response.tensor_type < MAX_DTYPES:
        return 0
    return (<long long>response.tensor_sizes[0]) * _DTYPE_SIZE[response.tensor_type]


def fuse_responses(responses, threshold):
    """See :func:`distlab.reference.coordinator.fuse_responses`."""
    cdef list items = [(<Response?>r).copy() for r in responses]
    cdef vector[_RespInfo] info
    cdef vector[int] order, group_start, members
    cdef Py_ssize_t i, n = len(items)
    info.resize(n)
    for i in range(n):
        _fill_info(&info[i], <Response>items[i])
        order.push_back(i)
    _fuse_plan(info, order, threshold, group_start, members)
    return [_fused_response(items, group_start, members, i, None, None)
            for i in range(<Py_ssize_t>group_start.size() - 1)]


cdef class Coordinator:
    """See :class:`distlab.reference.coordinator.Coordinator`."""

    cdef public int size, process_set_id
    cdef public long long fusion_threshold
    cdef public object stall, timeline
    cdef public list joined_ranks
    cdef dict _message_table        # name -> [Request], insertion-ordered (first arrival)
    cdef dict _groups               # group id -> _Group

    def __init__(self, size, process_set_id, fusion_threshold, stall, timeline=None):
        self.size = size
        self.process_set_id = process_set_id
        self.fusion_threshold = fusion_threshold
        self.stall = stall
        self.timeline = timeline
        self.joined_ranks = []
        self._message_table = {}
        self._groups = {}

    cpdef ResponseList coordinate(self, list gathered, ResponseCache cache, list cache_hits):
        """See :meth:`distlab.reference.coordinator.Coordinator.coordinate`."""
        cdef list ready = [], responses = [], fused
        cdef dict reasons = {}
        cdef RequestList request_list
        cdef Request request
        cdef Py_ssize_t sender
        cdef int joined_size, group_id
        cdef _Group group
        for sender in range(len(gathered)):
            try:
                request_list = self._checked_request_list(sender, gathered[sender])
            except MessageFormatError as error:
                return ResponseList([], True, refused_list_reason(sender, error), self.process_set_id)
            if request_list.shutdown:
                reasons[sender] = request_list.shutdown_reason
            for request in request_list.requests:
                if request.request_type == RT_JOIN:
                    if request.request_rank not in self.joined_ranks:
                        self.joined_ranks.append(request.request_rank)
                elif self._increment_tensor_count(request):
                    ready.append(request.name())
        joined_size = len(self.joined_ranks)
        if joined_size:
            # tensors of earlier cycles may be ready now that more ranks have joined
            for name, requests in self._message_table.items():
                if len(<list>requests) == self.size - joined_size and name not in ready:
                    ready.append(name)
        if joined_size < self.size:
            for bit in cache_hits:          # common hits first; peek keeps rank 0's LRU order like everyone's
                responses.append(cache.peek_response(bit))
        for name in ready:
            group_id = (<Request>(<list>self._message_table[name])[0]).group_id
            if group_id == NO_GROUP:
                responses.append(self._construct_response(name, joined_size))
            else:
                group = <_Group>self._groups[group_id]
                if name not in group.ready:
                    group.ready.append(name)
        responses.extend(self._ready_groups(joined_size))
        fused = fuse_responses(responses, self.fusion_threshold)
        if joined_size == self.size:
            fused.append(Response(ResponseType.JOIN, [JOIN_TENSOR_NAME], last_joined_rank=self.joined_ranks[-1]))
            self.joined_ranks = []
        return ResponseList(fused, len(reasons) > 0, shutdown_reason_text(reasons) if reasons else "",
                            self.process_set_id)

    cdef RequestList _checked_request_list(self, Py_ssize_t sender, payload):
        cdef RequestList request_list = RequestList.from_bytes(payload)
        cdef Request request
        if request_list.process_set_id != self.process_set_id:
            raise process_set_error("request list", request_list.process_set_id, self.process_set_id)
        for request in request_list.requests:
            if request.request_rank != sender:
                raise sender_error(sender, request.name(), request.request_rank)
        return request_list

    cdef bint _increment_tensor_count(self, Request request) except -1:
        cdef str name = request.name()
        cdef list requests = self._message_table.get(name)
        cdef _Group group
        if requests is None:
            requests = self._message_table[name] = []
            trace_negotiation_start(self.timeline, name, request.request_type)
        requests.append(request)
        if request.group_id != NO_GROUP:
            group = self._groups.get(request.group_id)
            if group is None:
                group = self._groups[request.group_id] = _Group()
            group.sizes[request.request_rank] = request.group_size
        self.stall.record_uncached(name, request.request_rank, request.request_type)
        return len(requests) == self.size - len(self.joined_ranks)

    cdef list _ready_groups(self, int joined_size):
        cdef list out = [], names, members
        cdef _Group group
        cdef Response member
        cdef set sizes
        for group_id in list(self._groups):
            group = <_Group>self._groups[group_id]
            if len(group.sizes) < self.size - joined_size:
                continue                                    # a rank has not submitted the group yet
            sizes = set(group.sizes.values())
            if len(sizes) == 1 and len(group.ready) < <int>next(iter(sizes)):
                continue                                    # a member is still missing: the group waits
            del self._groups[group_id]
            names = group.ready + [n for n in self._message_table
                                   if (<Request>self._message_table[n][0]).group_id == group_id
                                   and n not in group.ready]
            if len(sizes) > 1:
                for name in names:
                    self._message_table.pop(name, None)
                    self.stall.remove_uncached(name)
                out.append(Response(ResponseType.ERROR, names, 0, group_size_error(group_name_of(names[0]),
                                                                                    group.sizes),
                                    group_id=group_id))
                continue
            members = [self._construct_response(name, joined_size) for name in names]
            error = None
            for member in members:
                if member.response_type == ResponseType.ERROR:
                    error = group_member_error(group_name_of(names[0]), member.error_message)
                    break
            else:
                error = group_mismatch_error(group_name_of(names[0]), members)
            if error:
                member = members[0]
                out.append(Response(ResponseType.ERROR, names, member.tensor_type, error, member.devices,
                                    group_id=group_id))
            else:
                out.extend(members)
        return out

    cdef Response _construct_response(self, name, int joined_size):
        cdef list requests = sorted(self._message_table.pop(name), key=_request_rank)
        cdef Request first = requests[0]
        cdef Request r
        cdef int kind = first.request_type
        cdef list sizes
        self.stall.remove_uncached(name)
        # every rank sent the same parameters for an allreduce: no check can fail, skip building their texts
        error = None if _reduces(kind) and _uniform(requests) else response_error(name, requests, self.joined_ranks)
        if error is not None:
            return Response(ResponseType.ERROR, [name], first.tensor_type, error, [r.device for r in requests],
                            group_id=first.group_id)
        if _reduces(kind) or kind == RequestType.REDUCESCATTER:
            sizes = [first.num_elements()]
        elif kind == RequestType.ALLGATHER or kind == RequestType.ALLTOALL:
            sizes = [0] * self.size
            for r in requests:
                sizes[r.request_rank] = r.first_dim()
        else:
            sizes = []
        return Response(kind, [name], first.tensor_type, devices=[r.device for r in requests], tensor_sizes=sizes,
                        prescale_factor=first.prescale_factor, postscale_factor=first.postscale_factor,
                        reduce_op=first.reduce_op, group_id=first.group_id)


# --- core-only helpers ---------------------------------------------------------------------------------------
cdef inline bint _reduces(int request_type):
    return request_type == RT_ALLREDUCE or request_type == RT_ADASUM


def _request_rank(Request request):
    return request.request_rank


cdef bint _uniform(list requests):
    """Every rank sent the same type, dtype, shape, op, scale factors, root and device."""
    cdef Request first = requests[0]
    cdef Request r
    cdef Py_ssize_t i
    for i in range(1, len(requests)):
        r = requests[i]
        if not (r.request_type == first.request_type and r.tensor_type == first.tensor_type
                and r.same_shape(first) and r.reduce_op == first.reduce_op
                and r.prescale_factor == first.prescale_factor and r.postscale_factor == first.postscale_factor
                and r.root_rank == first.root_rank and r.device == first.device):
            return False
    return True


cdef int _fuse_plan(const vector[_RespInfo]& info, const vector[int]& order, long long limit,
                    vector[int]& group_start, vector[int]& members) except -1:
    """fuse_responses' grouping over C records: members[group_start[g]:group_start[g + 1]] is group g.

    A group's members all join its first member, whatever the threshold. Other allreduce/adasum responses fuse
    while type, devices, dtype, op and scale factors agree, they belong to no group, and the bytes stay under
    ``limit``; a response that does not fit is skipped over while the skipped bytes also fit (look-ahead).
    """
    cdef cppdeque[int] queue, rest
    cdef vector[int] skipped
    cdef int head, cand
    cdef long long size, skipped_size
    cdef size_t k
    cdef const _RespInfo* first
    cdef const _RespInfo* ci
    for k in range(order.size()):
        queue.push_back(order[k])
    group_start.clear()
    members.clear()
    while not queue.empty():
        head = queue.front()
        queue.pop_front()
        group_start.push_back(members.size())
        members.push_back(head)
        first = &info[head]
        if first.group_id != NO_GROUP:
            rest.clear()
            while not queue.empty():
                cand = queue.front()
                queue.pop_front()
                if info[cand].group_id == first.group_id:
                    members.push_back(cand)
                else:
                    rest.push_back(cand)
            queue.swap(rest)
            continue
        if not _reduces(first.rtype):
            continue
        size = first.nbytes
        skipped.clear()
        skipped_size = 0
        while not queue.empty():
            cand = queue.front()
            ci = &info[cand]
            if (ci.rtype == first.rtype and ci.group_id == NO_GROUP and ci.devices_id == first.devices_id
                    and ci.dtype == first.dtype and ci.op == first.op and ci.nbytes <= limit - size
                    and ci.pre == first.pre and ci.post == first.post):
                size += ci.nbytes
                members.push_back(cand)
                queue.pop_front()
            else:
                if ci.nbytes > limit - size - skipped_size:
                    break
                skipped_size += ci.nbytes
                skipped.push_back(cand)
                queue.pop_front()
        for k in range(skipped.size()):
            queue.push_front(skipped[skipped.size() - 1 - k])
    group_start.push_back(members.size())
    return 0


cdef Response _fused_response(list responses, vector[int]& group_start, vector[int]& members, Py_ssize_t g,
                              list names, list sizes):
    """Group ``g`` of a fusion plan as one Response (a copy of its first member with every name and size; ``names``
    and ``sizes``, when given, hold each member's name and size by index: the cache keeps them per slot)."""
    cdef int k, index
    cdef Response fused = (<Response>responses[members[group_start[g]]]).copy()
    for k in range(group_start[g] + 1, group_start[g + 1]):
        index = members[k]
        if names is not None:
            fused.tensor_names.append(names[index])
            fused.tensor_sizes.append(sizes[index])
        else:
            fused.tensor_names.append((<Response>responses[index]).tensor_names[0])
            fused.tensor_sizes.append((<Response>responses[index]).tensor_sizes[0])
    return fused


cdef dict _DEVICE_IDS = {}


cdef int _fill_info(_RespInfo* info, Response response) except -1:
    info.rtype = response.response_type
    info.dtype = response.tensor_type
    info.op = response.reduce_op
    info.pre = response.prescale_factor
    info.post = response.postscale_factor
    info.nbytes = _size_bytes(response)
    info.group_id = response.group_id
    key = tuple(response.devices)
    devices_id = _DEVICE_IDS.get(key)
    if devices_id is None:
        devices_id = _DEVICE_IDS[key] = len(_DEVICE_IDS)
    info.devices_id = devices_id
    return 0


cdef class _Group:
    # rank 0's state of one pending group: each rank's group size, and the members ready so far
    cdef dict sizes
    cdef list ready

    def __cinit__(self):
        self.sizes = {}
        self.ready = []
