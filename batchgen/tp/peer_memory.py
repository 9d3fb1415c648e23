"""The all-reduce of a decode step's CUDA graphs on GPUs of one host: each rank's receive buffer mapped into every
other rank's process (CUDA IPC), written by one Triton kernel (batchgen/tp/all_reduce_triton.py), whose rows cross
NVLink once; NCCL's all-reduce of a decode step's few rows is a kernel the next one cannot start beside (PDL), with
more trips over NVLink. NCCL keeps everything else: eager steps (prefill), tensors past `MAX_BYTES`, GPUs without
peer access, and `engine.custom_all_reduce=false` (vLLM's disable_custom_all_reduce).

The buffers are allocated with the CUDA runtime itself (ctypes), not torch's caching allocator, whose blocks lie at
offsets inside allocations an IPC handle does not say.
"""

from __future__ import annotations

import ctypes
import logging
import pickle
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from batchgen.config import EngineConfig

log = logging.getLogger(__name__)

# A call's tensor on one rank; larger ones go to NCCL: the kernel sends twice the bytes (a flag beside each word),
# so what it saves shrinks as the tensor grows
MAX_BYTES = 2 << 20
ROW_BYTES = 16 * 1024  # a row's data: hidden sizes up to 8,192 in bf16
SLOT_WORDS = ROW_BYTES // 4  # a row's slot: each 32-bit word of data with its flag, an int64
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_IPC_HANDLE_BYTES = 64
_IPC_LAZY_ENABLE_PEER_ACCESS = 1


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_byte * _IPC_HANDLE_BYTES)]


class CudaRuntime:
    """The few CUDA runtime calls torch does not offer: device memory outside its allocator, and IPC handles opened
    in this process's current device (torch opens a handle on the exporting device, making a context there)."""

    def __init__(self, device: torch.device) -> None:
        self.lib = ctypes.CDLL(_loaded_library("libcudart"))
        self.lib.cudaGetErrorString.restype = ctypes.c_char_p
        self.lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle, ctypes.c_uint]
        self.device = device.index

    def _check(self, code: int, call: str) -> None:
        if code != 0:
            raise RuntimeError(f"{call}: {self.lib.cudaGetErrorString(code).decode()}")

    def use_device(self) -> None:
        """Makes this rank's GPU current for the calls that follow (they act on the current device)."""
        self._check(self.lib.cudaSetDevice(self.device), "cudaSetDevice")

    def malloc_zeroed(self, nbytes: int) -> int:
        pointer = ctypes.c_void_p()
        self._check(self.lib.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(nbytes)), "cudaMalloc")
        self._check(self.lib.cudaMemset(pointer, 0, ctypes.c_size_t(nbytes)), "cudaMemset")
        self._check(self.lib.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
        return pointer.value

    def free(self, pointer: int) -> None:
        self._check(self.lib.cudaFree(ctypes.c_void_p(pointer)), "cudaFree")

    def export(self, pointer: int) -> bytes:
        handle = _IpcHandle()
        self._check(self.lib.cudaIpcGetMemHandle(ctypes.byref(handle), ctypes.c_void_p(pointer)), "cudaIpcGetMemHandle")
        return bytes(handle.reserved)

    def open(self, handle: bytes) -> int:
        pointer = ctypes.c_void_p()
        ipc = _IpcHandle()
        ctypes.memmove(ipc.reserved, handle, _IPC_HANDLE_BYTES)
        self._check(self.lib.cudaIpcOpenMemHandle(ctypes.byref(pointer), ipc, _IPC_LAZY_ENABLE_PEER_ACCESS),
                    "cudaIpcOpenMemHandle")
        return pointer.value

    def close(self, pointer: int) -> None:
        self._check(self.lib.cudaIpcCloseMemHandle(ctypes.c_void_p(pointer)), "cudaIpcCloseMemHandle")


def _loaded_library(prefix: str) -> str:
    """The path of the library this process has already loaded (torch's CUDA runtime), so that its calls act on
    the same contexts torch uses."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if path.rsplit("/", 1)[-1].startswith(prefix):
                return path
    raise RuntimeError(f"no {prefix} among this process's libraries")


def _device_tensor(pointer: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over nbytes of device memory torch did not allocate (and does not free)."""
    class Memory:
        __cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (pointer, False), "version": 3}

    return torch.as_tensor(Memory(), device=device)


@dataclass
class PeerAllReduce:
    """This rank's receive buffer, where every other rank's is in this process, and the kernel's bookkeeping. A
    receive buffer holds (size senders, 2, max_rows, SLOT_WORDS) int64: a row's 32-bit words, each beside its
    flag."""

    rank: int
    size: int
    runtime: CudaRuntime
    own: int  # this rank's receive buffer, allocated here
    peers: list[int]  # the other ranks' receive buffers, opened here
    receive: torch.Tensor  # int64, this rank's receive buffer
    receive_offsets: torch.Tensor  # int64 (size,): each rank's receive buffer from this rank's, in int64s
    counts: torch.Tensor  # int32 (max_rows,): calls a row, this rank's own
    stop: torch.Tensor  # int32 (1,): nonzero ends every wait of the kernel
    stopped: torch.Tensor  # int32 (1,) pinned host memory holding 1, for abort

    @classmethod
    def create(cls, store: dist.Store, agree_min: Callable[[int], int], rank: int, size: int, device: torch.device,
               max_rows: int) -> PeerAllReduce | None:
        """Every rank calls it at once; returns None on every rank unless every rank could map every other's buffer
        (then the layers' all-reduces stay with NCCL). agree_min: the control group's (ControlChannel.agree_min)."""
        runtime, own, peers, failure = None, None, [], None
        nbytes = size * 2 * max_rows * SLOT_WORDS * 8
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        with torch.cuda.device(device):
            try:
                others = [r for r in range(size) if r != rank]
                if not all(torch.cuda.can_device_access_peer(device, _peer_device(device, rank, r)) for r in others):
                    raise RuntimeError("the GPUs have no peer access to each other")
                runtime = CudaRuntime(device)
                runtime.use_device()
                own = runtime.malloc_zeroed(nbytes)
                handle = runtime.export(own)
            except (RuntimeError, OSError) as error:
                failure, handle = error, b""
            store.set(_handle_key(rank), pickle.dumps(handle))
            handles = {r: pickle.loads(store.get(_handle_key(r))) for r in range(size) if r != rank}
            if failure is None:
                try:
                    if not all(handles.values()):
                        raise RuntimeError("another rank could not share its buffer")
                    peers = [runtime.open(handles[r]) if r != rank else own for r in range(size)]
                except RuntimeError as error:
                    failure = error
            if agree_min(int(failure is None)) == 0:
                if failure is not None:
                    log.warning("the decode steps' all-reduces run on NCCL: %s", failure)
                if runtime is not None:
                    _release(runtime, own, [p for p in peers if p != own])
                return None
            log.info("tensor parallel: the decode graphs' all-reduces through mapped buffers (%.0f MiB a GPU)",
                     nbytes / 2**20)
            return cls(rank, size, runtime, own, [p for p in peers if p != own],
                       _device_tensor(own, nbytes, device).view(torch.int64),
                       torch.tensor([(p - own) // 8 for p in peers], dtype=torch.int64, device=device),
                       torch.zeros(max_rows, dtype=torch.int32, device=device),
                       torch.zeros(1, dtype=torch.int32, device=device),
                       torch.ones(1, dtype=torch.int32).pin_memory())

    @property
    def max_rows(self) -> int:
        return self.counts.shape[0]

    def accepts(self, tensor: torch.Tensor) -> bool:
        """Whether this kernel sums `tensor`: only inside a CUDA graph's capture (the same on every rank: the ranks
        capture the same graphs), a 2-D tensor of rows of whole 32-bit words that fit a slot, at most MAX_BYTES in
        all."""
        if not (torch.cuda.is_current_stream_capturing() and tensor.dim() == 2 and tensor.dtype in DTYPES):
            return False
        item = tensor.element_size()
        return (tensor.stride(1) == 1 and tensor.shape[0] <= self.max_rows and tensor.shape[1] * item <= ROW_BYTES
                and (tensor.shape[1] * item) % 4 == 0 and (tensor.stride(0) * item) % 4 == 0
                and (tensor.storage_offset() * item) % 4 == 0 and tensor.numel() * item <= MAX_BYTES)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        from batchgen.tp.all_reduce_triton import one_shot_all_reduce  # Triton only on CUDA

        one_shot_all_reduce(tensor, self.receive, self.receive_offsets, self.counts, self.stop, SLOT_WORDS,
                            self.rank, self.size)

    def abort(self) -> None:
        """Ends every wait of the kernel, now and after (a rank died: its words will never come), so that no kernel
        of this rank's stream waits forever; the sums are garbage from then on. Written from pinned memory on a
        stream of its own, which the copy engine runs beside the waiting kernel."""
        with torch.cuda.device(self.stop.device), torch.cuda.stream(torch.cuda.Stream(self.stop.device)):
            self.stop.copy_(self.stopped, non_blocking=True)

    def close(self) -> None:
        """Rank 0, after its followers have exited: unmaps their buffers and frees its own."""
        self.runtime.use_device()
        _release(self.runtime, self.own, self.peers)


def _release(runtime: CudaRuntime, own: int | None, others: list[int]) -> None:
    """Unmaps the other ranks' buffers, then frees this rank's own (None: never allocated)."""
    for pointer in others:
        runtime.close(pointer)
    if own is not None:
        runtime.free(own)


def peer_rows(engine: EngineConfig) -> int:
    """The most rows of a call the buffers hold: the largest decode graph's; 0 (NCCL alone) without graphs or with
    engine.custom_all_reduce=false."""
    if not engine.custom_all_reduce or engine.enforce_eager:
        return 0
    return engine.cuda_graph_sizes[-1]


def _peer_device(device: torch.device, rank: int, other: int) -> torch.device:
    return torch.device("cuda", device.index - rank + other)


def _handle_key(rank: int) -> str:
    return f"peer_memory/{rank}"
