"""Shared-memory regions: tensors a runner on the server's host shares with the server.

A region is registered once and then referenced by DecodeLayer tensors, so a layer step
crosses the socket as a small control message. System regions are POSIX shared memory
(numpy or torch CPU views of it); CUDA regions are a torch CUDA tensor's allocation,
shared through CUDA IPC. The server must run with --allow_client_shm.
"""
from multiprocessing import shared_memory

import numpy as np

from ._stubs import pb

ALIGN = 256  # every allocation starts on a 256-byte boundary (CUDA loads, cache lines)


class _Region:
    """Registered memory [base, base + byte_size) under `name`."""

    kind = None

    def __init__(self, client, name, base, byte_size):
        self.client, self.name, self.base, self.byte_size = client, name, base, byte_size
        self._next = 0
        self._open = True

    def contains(self, address, nbytes):
        return self._open and self.base <= address and address + nbytes <= self.base + self.byte_size

    def ref(self, address, nbytes):
        return pb.RegionRef(region=self.name, offset=address - self.base, byte_size=nbytes)

    def _take(self, nbytes):
        offset = -(-self._next // ALIGN) * ALIGN
        if offset + nbytes > self.byte_size:
            raise MemoryError(f"region '{self.name}' has {self.byte_size - offset} bytes left, "
                              f"{nbytes} asked")
        self._next = offset + nbytes
        return offset

    def close(self):
        """Unregisters the region (idempotent). Calls still using it fail
        FAILED_PRECONDITION and write nothing into it after this returns."""
        if self._open:
            self._open = False
            self.client._forget_region(self)
            self.client._call(self.client._stub.UnregisterRegion,
                              pb.UnregisterRegionRequest(name=self.name), None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SystemRegion(_Region):
    """POSIX shared memory of `byte_size` bytes, created by this process and registered.

    numpy(shape, dtype) and torch(shape, dtype) hand out views of fresh, aligned parts of
    it; tensors in those views travel by reference in decode_layer.
    """

    kind = "system"

    def __init__(self, client, name, byte_size):
        self._shm = shared_memory.SharedMemory(create=True, size=byte_size)
        whole = np.ndarray((byte_size,), dtype=np.uint8, buffer=self._shm.buf)
        base = whole.ctypes.data
        del whole
        super().__init__(client, name, base, byte_size)
        req = pb.RegisterRegionRequest(name=name, system=pb.SystemRegion(
            shm_name="/" + self._shm.name, offset=0, byte_size=byte_size))
        try:
            client._call(client._stub.RegisterRegion, req, None)
        except Exception:
            self._free()
            raise
        client._remember_region(self)

    def numpy(self, shape, dtype):
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        offset = self._take(nbytes)
        return np.ndarray(shape, dtype=dtype, buffer=self._shm.buf, offset=offset)

    def torch(self, shape, dtype):
        import torch
        nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
        offset = self._take(nbytes)
        return torch.frombuffer(self._shm.buf, dtype=dtype, count=int(np.prod(shape)),
                                offset=offset).view(*shape)

    def _free(self):
        try:
            self._shm.close()
        except BufferError:
            pass  # views still alive; the mapping goes with them
        self._shm.unlink()

    def close(self):
        was_open = self._open
        super().close()
        if was_open:
            self._free()


class CudaRegion(_Region):
    """A torch CUDA tensor's memory, shared with the server through CUDA IPC.

    The tensor must stay alive (and unmoved) while the region is registered; tensors
    that lie inside it travel by reference in decode_layer.
    """

    kind = "cuda"

    def __init__(self, client, name, tensor):
        import torch
        if not tensor.is_cuda or not tensor.is_contiguous():
            raise ValueError("a CUDA region is a contiguous torch CUDA tensor")
        storage = tensor.untyped_storage()
        # (device, handle, storage bytes, storage offset in the allocation, ...)
        shared = storage._share_cuda_()
        device, handle, offset_in_block = shared[0], _ipc_handle(shared[1]), shared[3]
        nbytes = tensor.numel() * tensor.element_size()
        offset = offset_in_block + tensor.storage_offset() * tensor.element_size()
        super().__init__(client, name, tensor.data_ptr(), nbytes)
        self.tensor = tensor
        req = pb.RegisterRegionRequest(name=name, cuda=pb.CudaRegion(
            ipc_handle=bytes(handle), device_id=int(device), offset=offset, byte_size=nbytes))
        client._call(client._stub.RegisterRegion, req, None)
        client._remember_region(self)
        torch.cuda.synchronize(tensor.device)

    def torch(self, shape, dtype):
        import torch
        count = int(np.prod(shape))
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        offset = self._take(nbytes)
        flat = self.tensor.view(torch.uint8).view(-1)[offset:offset + nbytes]
        return flat.view(dtype).view(*shape)


_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t)


def _ipc_handle(shared):
    """The cudaIpcMemHandle_t in what torch's _share_cuda_ returns: the 64 bytes alone
    (older torch), or after a version byte and a kind byte, b"c" for a cudaMalloc block
    (torch >= 2.2)."""
    shared = bytes(shared)
    if len(shared) == _IPC_HANDLE_BYTES:
        return shared
    if len(shared) == _IPC_HANDLE_BYTES + 2 and shared[1:2] == b"c":
        return shared[2:]
    raise ValueError(
        f"cannot share this tensor through CUDA IPC (a {len(shared)}-byte torch handle of "
        f"kind {shared[1:2]!r}); with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True torch "
        "allocates memory that cudaIpcGetMemHandle cannot share")


def address_of(array):
    """(address, nbytes, device) of a C-contiguous numpy array or torch tensor, or None
    when it is not contiguous (it then travels as bytes)."""
    if isinstance(array, np.ndarray):
        if not array.flags["C_CONTIGUOUS"]:
            return None
        return array.ctypes.data, array.nbytes, "cpu"
    if hasattr(array, "data_ptr"):
        if not array.is_contiguous():
            return None
        return array.data_ptr(), array.numel() * array.element_size(), array.device.type
    return None


__all__ = ["SystemRegion", "CudaRegion", "address_of"]
