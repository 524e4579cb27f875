"""Rank 0's side of the slow path: the message table, when a tensor is ready, groups, validation and fusion.

Twinned with ``core/_coordinator.pxi`` (included by ``core/_negotiation.pyx``).

Mirrors horovod/common/controller.cc ``IncrementTensorCount``, ``ConstructResponse`` and ``FuseResponses``, the
part of ``ComputeResponseList`` that runs on the coordinator (``is_coordinator_``), and the group handling of
``GroupTable``. Each slow-path cycle, every rank's request list reaches rank 0, which

1. checks each list: it must be for this process set and speak only for the rank that sent it (a list that cannot
   be trusted stops every rank, with the reason, instead of breaking the coordinator);
2. counts the requests per name: a tensor is ready when every rank that has not joined sent it;
3. holds the ready members of a group until the group's fate is decided: all its members ready (one response),
   or the ranks disagree on its members (one error for the whole group);
4. validates the requests of each ready tensor (an inconsistent tensor gets an ERROR response that every rank
   raises) and builds its response;
5. fuses the responses up to the fusion threshold (a group is always one response) and answers with the list
   every rank runs, with the shutdown flag and the reasons of the ranks that asked to stop.
"""
from __future__ import annotations

from collections import OrderedDict, deque

from distlab._common.negotiation import (
    group_member_error,
    group_mismatch_error,
    group_name_of,
    group_size_error,
    process_set_error,
    refused_list_reason,
    response_error,
    sender_error,
    shutdown_reason_text,
    trace_negotiation_start,
)
from distlab._wire import DTYPE_SIZES, JOIN_TENSOR_NAME, NO_GROUP, RequestType, ResponseType
from distlab.errors import MessageFormatError
from distlab.reference.messages import RequestList, Response, ResponseList

__all__ = ["Coordinator", "fuse_responses"]


def _size_bytes(response) -> int:
    return response.tensor_sizes[0] * DTYPE_SIZES[response.tensor_type] if response.tensor_sizes else 0


def _fusable(response, candidate, size: int, threshold: int) -> bool:
    """Can ``candidate`` join ``response``'s fusion buffer (same kind of reduction, and it fits)?"""
    return (candidate.response_type == response.response_type
            and candidate.group_id == NO_GROUP
            and candidate.devices == response.devices
            and candidate.tensor_type == response.tensor_type
            and candidate.reduce_op == response.reduce_op
            and _size_bytes(candidate) <= threshold - size      # size + it <= threshold, never past int64
            and candidate.prescale_factor == response.prescale_factor
            and candidate.postscale_factor == response.postscale_factor)


def fuse_responses(responses, threshold: int) -> list:
    """Fuse single-tensor allreduce/adasum responses up to ``threshold`` bytes (mirrors FuseResponses).

    Responses fuse when type, devices, dtype, reduce op and scale factors agree. As Horovod does, a response that
    does not fit is skipped over while the skipped bytes stay under the threshold (look-ahead), then put back.
    The members of a group become one response whatever the threshold, and never fuse with anything else. Other
    response types are passed through unfused.
    """
    queue = deque(r.copy() for r in responses)
    out = []
    while queue:
        response = queue.popleft()
        if response.group_id != NO_GROUP:
            # a group is all or nothing: every member of it in this list joins its first member
            rest = deque()
            for candidate in queue:
                if candidate.group_id == response.group_id:
                    response.tensor_names.extend(candidate.tensor_names)
                    response.tensor_sizes.extend(candidate.tensor_sizes)
                else:
                    rest.append(candidate)
            queue = rest
        elif response.response_type in (ResponseType.ALLREDUCE, ResponseType.ADASUM):
            size = _size_bytes(response)
            skipped = []
            skipped_size = 0
            while queue:
                candidate = queue[0]
                if _fusable(response, candidate, size, threshold):
                    size += _size_bytes(candidate)
                    response.tensor_names.append(candidate.tensor_names[0])
                    response.tensor_sizes.append(candidate.tensor_sizes[0])
                    queue.popleft()
                else:
                    if _size_bytes(candidate) > threshold - size - skipped_size:
                        break
                    skipped_size += _size_bytes(candidate)
                    skipped.append(queue.popleft())
            queue.extendleft(reversed(skipped))
        out.append(response)
    return out


class Coordinator:
    """Rank 0's negotiation state for one process set: who asked for what, which groups are pending.

    Parameters
    ----------
    size : int
        The number of ranks in the process set.
    process_set_id : int
        The process set; lists for another one are refused.
    fusion_threshold : int
        Fusion buffer size in bytes.
    stall : distlab._common.stall.StallInspector
        Told when a tensor starts and stops waiting for ranks.
    timeline : distlab.timeline.Timeline, optional
        Gets an instant when a tensor's negotiation starts.
    """

    def __init__(self, size, process_set_id, fusion_threshold, stall, timeline=None):
        self.size = int(size)
        self.process_set_id = int(process_set_id)
        self.fusion_threshold = int(fusion_threshold)
        self.stall = stall
        self.timeline = timeline
        #: Ranks that have joined, in the order they joined (the last one is returned by join()).
        self.joined_ranks: list[int] = []
        self._message_table: OrderedDict[str, list] = OrderedDict()   # name -> requests, by first arrival
        self._groups: dict[int, dict] = {}          # group id -> {"sizes": {rank: n}, "ready": [names]}

    def coordinate(self, gathered, cache, cache_hits) -> ResponseList:
        """Count requests, find the ready tensors, build and fuse their responses (rank 0's slow path).

        Parameters
        ----------
        gathered : list of bytes
            Every rank's RequestList, by rank.
        cache : ResponseCache
            Rank 0's cache, for the responses of the common hits (``peek_response``: the LRU order stays as
            everyone's).
        cache_hits : list of int
            The bits that hit on every rank this cycle (none when the cache is off).
        """
        ready: list[str] = []
        reasons: dict[int, str] = {}
        for sender, payload in enumerate(gathered):
            try:
                request_list = self._checked_request_list(sender, payload)
            except MessageFormatError as error:
                # A list that cannot be trusted stops every rank, saying why (rather than a dead coordinator).
                return ResponseList(shutdown=True, shutdown_reason=refused_list_reason(sender, error),
                                    process_set_id=self.process_set_id)
            if request_list.shutdown:
                reasons[sender] = request_list.shutdown_reason
            for request in request_list.requests:
                if request.request_type == RequestType.JOIN:
                    if request.request_rank not in self.joined_ranks:
                        self.joined_ranks.append(request.request_rank)
                    continue
                if self._increment_tensor_count(request):
                    ready.append(request.tensor_name)
        joined_size = len(self.joined_ranks)
        if joined_size:
            # Tensors from earlier cycles may be ready now that more ranks have joined.
            for name, requests in self._message_table.items():
                if len(requests) == self.size - joined_size and name not in ready:
                    ready.append(name)
        responses = []
        if joined_size < self.size:
            # Common hits first, least recently used first; peek keeps rank 0's LRU order like everyone's.
            responses.extend(cache.peek_response(bit) for bit in cache_hits)
        for name in ready:
            group_id = self._message_table[name][0].group_id
            if group_id == NO_GROUP:
                responses.append(self._construct_response(name, joined_size))
            elif name not in self._groups[group_id]["ready"]:
                self._groups[group_id]["ready"].append(name)       # held until the whole group is ready
        responses.extend(self._ready_groups(joined_size))
        fused = fuse_responses(responses, self.fusion_threshold)
        if joined_size == self.size:
            fused.append(Response(ResponseType.JOIN, [JOIN_TENSOR_NAME], last_joined_rank=self.joined_ranks[-1]))
            self.joined_ranks = []
        return ResponseList(fused, bool(reasons), shutdown_reason_text(reasons) if reasons else "",
                            self.process_set_id)

    def _checked_request_list(self, sender: int, payload) -> RequestList:
        """Parse ``sender``'s list and check it is for this process set and speaks only for ``sender``."""
        request_list = RequestList.from_bytes(payload)
        if request_list.process_set_id != self.process_set_id:
            raise process_set_error("request list", request_list.process_set_id, self.process_set_id)
        for request in request_list.requests:
            if request.request_rank != sender:
                raise sender_error(sender, request.tensor_name, request.request_rank)
        return request_list

    def _increment_tensor_count(self, request) -> bool:
        """Record one rank's request; True when every rank that has not joined sent it (IncrementTensorCount)."""
        name = request.tensor_name
        requests = self._message_table.get(name)
        if requests is None:
            requests = self._message_table[name] = []
            trace_negotiation_start(self.timeline, name, request.request_type)
        requests.append(request)
        if request.group_id != NO_GROUP:
            group = self._groups.setdefault(request.group_id, {"sizes": {}, "ready": []})
            group["sizes"][request.request_rank] = request.group_size
        self.stall.record_uncached(name, request.request_rank, request.request_type)
        return len(requests) == self.size - len(self.joined_ranks)

    def _ready_groups(self, joined_size) -> list:
        """One response per group whose fate is decided: every member ready, or the ranks disagree on them.

        A group is decided once every rank that has not joined submitted it; until then it waits as one.
        """
        out = []
        for group_id, group in list(self._groups.items()):
            sizes = group["sizes"]
            if len(sizes) < self.size - joined_size:
                continue
            if len(set(sizes.values())) == 1 and len(group["ready"]) < next(iter(sizes.values())):
                continue                          # same size everywhere but a member still missing: wait
            del self._groups[group_id]
            names = group["ready"] + [n for n, rs in self._message_table.items()
                                      if rs[0].group_id == group_id and n not in group["ready"]]
            group_name = group_name_of(names[0])
            if len(set(sizes.values())) > 1:
                for name in names:
                    self._message_table.pop(name, None)
                    self.stall.remove_uncached(name)
                out.append(Response(ResponseType.ERROR, names, error_message=group_size_error(group_name, sizes),
                                    group_id=group_id))
                continue
            members = [self._construct_response(name, joined_size) for name in names]
            error = next((m.error_message for m in members if m.response_type == ResponseType.ERROR), None)
            error = group_member_error(group_name, error) if error else group_mismatch_error(group_name, members)
            if error:
                out.append(Response(ResponseType.ERROR, names, members[0].tensor_type, error_message=error,
                                    devices=members[0].devices, group_id=group_id))
            else:
                out.extend(members)                   # fuse_responses makes them one response
        return out

    def _construct_response(self, name, joined_size) -> Response:
        """Validate the requests for ``name`` and build its response, or an ERROR (mirrors ConstructResponse)."""
        requests = sorted(self._message_table.pop(name), key=lambda r: r.request_rank)
        self.stall.remove_uncached(name)
        first = requests[0]
        error = response_error(name, requests, self.joined_ranks)
        if error is not None:
            return Response(ResponseType.ERROR, [name], first.tensor_type, error_message=error,
                            devices=[r.device for r in requests], group_id=first.group_id)
        # By rank when every rank took part; shorter when some joined (then the response is not cached).
        devices = [r.device for r in requests]
        kind = first.request_type
        sizes = []
        if kind in (RequestType.ALLGATHER, RequestType.ALLTOALL):
            sizes = [0] * self.size             # allgather: each rank's first dimension, by rank
            for r in requests:
                sizes[r.request_rank] = r.tensor_shape[0]
        elif kind in (RequestType.ALLREDUCE, RequestType.ADASUM, RequestType.REDUCESCATTER):
            count = 1                           # allreduce: the element count
            for d in first.tensor_shape:
                count *= d
            sizes = [count]
        return Response(kind, [name], first.tensor_type, devices=devices, tensor_sizes=sizes,
                        prescale_factor=first.prescale_factor, postscale_factor=first.postscale_factor,
                        reduce_op=first.reduce_op, group_id=first.group_id)
