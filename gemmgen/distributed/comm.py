"""The ring the key/value blocks travel on: each rank sends to rank + 1 and receives from rank - 1.

    Ring                the protocol the schedule uses (rank, world, exchange, all_gather)
    ProcessGroupRing    a torch.distributed group: point-to-point with batch_isend_irecv (NCCL on
                        GPUs, gloo on CPU); on CUDA the transfer runs on a side stream
    LocalRing           W endpoints in one process, one per thread: for tests and debugging
    ring_for(group)     the Ring for ring_attention's `group` argument
"""
from __future__ import annotations

import queue
import threading
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from gemmgen.errors import InputError


class Transfer(Protocol):
    """An exchange in flight."""

    def wait(self) -> torch.Tensor:
        """The tensor received from rank - 1, ready for use on the current stream."""
        ...


@runtime_checkable
class Ring(Protocol):
    """One rank's end of a ring of `world` ranks.

    exchange(t, tag) sends t to rank + 1 and receives a tensor of t's shape and dtype from
    rank - 1; every rank makes the same exchanges in the same order, and `tag` keeps apart two
    exchanges in flight at once. t must stay unmodified until the transfer's wait() returns.
    all_gather(t) returns every rank's t, in rank order."""
    rank: int
    world: int

    def exchange(self, tensor: torch.Tensor, tag: int) -> Transfer: ...

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]: ...

    def check_device(self, device: torch.device) -> None: ...


class _Pending:
    """batch_isend_irecv's requests and the buffer they receive into."""

    def __init__(self, works: list, received: torch.Tensor, side: torch.cuda.Stream | None = None):
        self._works, self._received, self._side = works, received, side

    def wait(self) -> torch.Tensor:
        if self._side is None:
            for w in self._works:
                w.wait()
            return self._received
        # NCCL's wait orders the current stream after the transfer: make that the side stream,
        # then let the consumer's stream wait for the side stream.
        with torch.cuda.stream(self._side):
            for w in self._works:
                w.wait()
        torch.cuda.current_stream(self._received.device).wait_stream(self._side)
        return self._received


_side_streams: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream transfers are issued on, one per GPU: kernels queued on the compute stream after
    a transfer starts do not wait for it, and it does not wait for them."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _side_streams.get(index)
    if stream is None:
        stream = _side_streams[index] = torch.cuda.Stream(device=index)
    return stream


class ProcessGroupRing:
    """The ring over the ranks of a torch.distributed group (None: the default group), in group
    rank order."""

    def __init__(self, group: dist.ProcessGroup | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group)).lower()
        self._next = self._global((self.rank + 1) % self.world)
        self._prev = self._global((self.rank - 1) % self.world)

    def _global(self, group_rank: int) -> int:
        """P2POp names peers by their rank in the default group."""
        if self.group is None or self.group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def check_device(self, device: torch.device) -> None:
        """InputError when the backend cannot move tensors of this device."""
        if self.backend == "nccl" and device.type != "cuda":
            raise InputError(f"the group's backend is NCCL, which moves CUDA tensors; the tensors are on {device} "
                             f"(use a gloo group for CPU tensors)")
        if self.backend == "gloo" and device.type != "cpu":
            raise InputError(f"the group's backend is gloo, whose point-to-point transfers move CPU tensors; the "
                             f"tensors are on {device} (use an NCCL group for CUDA tensors)")

    def _ops(self, tensor: torch.Tensor, received: torch.Tensor, tag: int) -> list:
        return [dist.P2POp(dist.isend, tensor, self._next, self.group, tag),
                dist.P2POp(dist.irecv, received, self._prev, self.group, tag)]

    def exchange(self, tensor: torch.Tensor, tag: int) -> Transfer:
        tensor = tensor.contiguous()
        received = torch.empty_like(tensor)
        if not tensor.is_cuda:
            return _Pending(dist.batch_isend_irecv(self._ops(tensor, received, tag)), received)
        side = side_stream(tensor.device)
        side.wait_stream(torch.cuda.current_stream(tensor.device))  # `tensor` is written on the compute stream
        with torch.cuda.device(tensor.device), torch.cuda.stream(side):
            works = dist.batch_isend_irecv(self._ops(tensor, received, tag))
        # Both buffers were allocated on the compute stream and are used on the side stream: the
        # allocator must not hand their memory out again before the side stream is done with them.
        tensor.record_stream(side)
        received.record_stream(side)
        return _Pending(works, received, side)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        tensor = tensor.contiguous()
        out = [torch.empty_like(tensor) for _ in range(self.world)]
        dist.all_gather(out, tensor, group=self.group)
        return out


class _Mailboxes:
    """What the endpoints of one LocalRing share: a queue per (receiving rank, tag), and a board
    for all_gather."""

    def __init__(self, world: int, timeout: float):
        self.world, self.timeout = world, timeout
        self.lock = threading.Lock()
        self.queues: dict[tuple[int, int], queue.Queue] = {}
        self.board: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=timeout)

    def queue_for(self, rank: int, tag: int) -> queue.Queue:
        with self.lock:
            return self.queues.setdefault((rank, tag), queue.Queue())


class LocalRing:
    """One of `world` in-process ranks, each driven by its own thread (LocalRing.create(world)
    makes the endpoints). A transfer is a copy handed over through a queue; a rank waits at most
    `timeout` seconds for a block, then raises (another rank failed or took other steps).

    CPU tensors train through autograd; CUDA tensors do in the forward only, because autograd runs
    every backward of one GPU on a single worker thread, where the ranks would wait on each other
    (drive gemmgen.distributed.ring_backward from the threads instead)."""

    def __init__(self, rank: int, mailboxes: _Mailboxes):
        self.rank, self.world, self._boxes = rank, mailboxes.world, mailboxes

    @classmethod
    def create(cls, world: int, timeout: float = 120.0) -> list["LocalRing"]:
        if not isinstance(world, int) or world < 1:
            raise InputError(f"a LocalRing needs at least one rank; got world={world!r}")
        boxes = _Mailboxes(world, timeout)
        return [cls(r, boxes) for r in range(world)]

    @staticmethod
    def run(rings: list["LocalRing"], fn) -> list:
        """fn(ring) for each ring of `rings` (from create), each on its own thread; the results in
        rank order. The first exception a rank raised is raised here, after every thread ended."""
        results: list = [None] * len(rings)

        def rank_main(r: int) -> None:
            try:
                results[r] = fn(rings[r])
            except BaseException as exc:  # re-raised in the caller's thread below
                results[r] = exc

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(rings))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results

    def check_device(self, device: torch.device) -> None:
        """Any device: a transfer is a copy."""

    def exchange(self, tensor: torch.Tensor, tag: int) -> Transfer:
        nxt, prev = (self.rank + 1) % self.world, (self.rank - 1) % self.world
        self._boxes.queue_for(nxt, tag).put(tensor.clone(memory_format=torch.contiguous_format))
        return _LocalTransfer(self._boxes.queue_for(self.rank, tag), prev, self._boxes.timeout)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        boxes = self._boxes
        boxes.barrier.wait()  # nobody still reads the board of an earlier all_gather
        boxes.board[self.rank] = tensor.clone()
        boxes.barrier.wait()
        return list(boxes.board)


class _LocalTransfer:
    def __init__(self, box: queue.Queue, source: int, timeout: float):
        self._box, self._source, self._timeout = box, source, timeout

    def wait(self) -> torch.Tensor:
        try:
            return self._box.get(timeout=self._timeout)
        except queue.Empty:
            raise RuntimeError(f"no block arrived from rank {self._source} within {self._timeout:.0f} s "
                               "(that rank failed or did not take the same steps)") from None


def ring_for(group: object) -> Ring:
    """The Ring of ring_attention's `group`: a Ring as it is, else a torch.distributed group (None:
    the default one), which needs an initialized process group."""
    if isinstance(group, Ring):
        return group
    if not dist.is_available() or not dist.is_initialized():
        raise InputError("context-parallel attention needs torch.distributed initialized "
                         "(torch.distributed.init_process_group) or a gemmgen.distributed.LocalRing as group")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise InputError(f"group must be a torch.distributed ProcessGroup, None (the default group) or a "
                         f"gemmgen.distributed.LocalRing; got {type(group).__name__}")
    return ProcessGroupRing(group)
