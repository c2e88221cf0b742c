"""Tensors in and out: bf16 from numpy (uint16 bits, ml_dtypes.bfloat16, floats) and torch
CPU tensors, exact shape checks, and the wire's raw little-endian C-contiguous bytes.

torch is never imported here unless the caller passed a torch tensor (it is then loaded
already); the bf16 conversions are ml_dtypes' and torch's own (round to nearest even).
"""
import math
import sys
from typing import Any, Sequence, Tuple, Union

import ml_dtypes
import numpy as np

from ._stubs import pb

BF16 = np.dtype(ml_dtypes.bfloat16)
ArrayLike = Union[np.ndarray, "torch.Tensor", Sequence[float]]  # noqa: F821 (torch optional)
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def is_torch(x: Any) -> bool:
    return type(x).__module__.split(".")[0] == "torch" and hasattr(x, "data_ptr")


def torch_to_numpy(x, name: str) -> np.ndarray:
    """A CPU torch tensor as numpy (bf16 as uint16 bits), without copying when it can."""
    torch = sys.modules["torch"]
    if x.is_cuda:
        raise ValueError(f"{name}: a CUDA tensor travels only inside a registered CUDA region "
                         "(register_cuda_region and decode_layer); move it with .cpu() otherwise")
    x = x.detach()
    if x.is_floating_point() and x.dtype != torch.bfloat16:
        x = x.to(torch.bfloat16)
    if x.dtype == torch.bfloat16:
        return x.contiguous().view(torch.int16).numpy().view(np.uint16)
    return x.contiguous().numpy()


def float32_to_bf16_bits(x: ArrayLike) -> np.ndarray:
    """Floats -> bf16 bits as uint16, round to nearest even (NaN stays NaN, Inf stays Inf)."""
    return np.ascontiguousarray(np.asarray(x, dtype=np.float32).astype(BF16)).view(np.uint16)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(bits, dtype=np.uint16)).view(BF16).astype(np.float32)


def bf16_bits(x: ArrayLike, name: str = "tensor") -> np.ndarray:
    """bf16 bits (C-contiguous uint16) of uint16 bits, ml_dtypes.bfloat16, a float array or
    a torch CPU tensor (bf16, or floats converted by torch)."""
    a = torch_to_numpy(x, name) if is_torch(x) else np.asarray(x)
    if a.dtype == np.uint16:
        return np.ascontiguousarray(a)
    if a.dtype == BF16:
        return np.ascontiguousarray(a).view(np.uint16)
    if np.issubdtype(a.dtype, np.floating):
        return np.ascontiguousarray(a.astype(BF16)).view(np.uint16)
    raise TypeError(f"{name}: expected bf16 (torch.bfloat16, ml_dtypes.bfloat16, or uint16 "
                    f"bits) or floats, got {a.dtype}")


as_bf16_bits = bf16_bits  # the older name


def shape_error(name: str, got: Sequence[int], want: Sequence[int], layout: str) -> ValueError:
    """The error for a tensor of the wrong shape: names both, and the likely mistake."""
    got, want = list(got), list(want)
    hint = ""
    if len(got) == 4:
        hint = (f" (a 4-D [batch, heads, seq, head_dim] tensor, transformers' layout, is "
                f"not accepted: give {layout}; nothing is reshaped)")
    elif sorted(got) == sorted(want):
        hint = f" (the right sizes in another order: transposed? give {layout})"
    return ValueError(f"{name}: shape must be {layout} = {want}, got {got}{hint}")


def check_shape(name: str, a: Any, want: Sequence[int], layout: str) -> None:
    if tuple(a.shape) != tuple(want):
        raise shape_error(name, a.shape, want, layout)


def bf16_data(x: ArrayLike, name: str, want: Sequence[int], layout: str) -> bytes:
    """The wire bytes of a bf16 tensor of exactly shape `want`."""
    bits = bf16_bits(x, name)
    check_shape(name, bits, want, layout)
    return bits.tobytes()


def int32_array(values: Any, name: str = "indices") -> np.ndarray:
    """Integers -> C-contiguous little-endian int32. Values outside int32 are rejected, not
    wrapped: a cast would turn 2**32 - 1 into -1, which the server reads as "skip"."""
    a = torch_to_numpy(values, name) if is_torch(values) else np.asarray(values)
    if a.size == 0:
        a = a.astype(np.int32)  # np.asarray([]) is float64
    if not np.issubdtype(a.dtype, np.integer):  # floats would be truncated, bools are no indices
        raise TypeError(f"{name}: expected integers, got {a.dtype}")
    if a.dtype != np.int32 and a.size and (int(a.min()) < INT32_MIN or int(a.max()) > INT32_MAX):
        bad = next(int(x) for x in a.flat if not INT32_MIN <= int(x) <= INT32_MAX)
        raise ValueError(f"{name}: {bad} is outside int32 [{INT32_MIN}, {INT32_MAX}]")
    return np.ascontiguousarray(a, dtype="<i4")


def int32_tensor(values: Any, name: str = "indices") -> "pb.Tensor":
    a = int32_array(values, name)
    return pb.Tensor(dtype=pb.INT32, shape=list(a.shape), data=a.tobytes())


def bf16_tensor(bits: np.ndarray, shape: Tuple[int, ...]) -> "pb.Tensor":
    return pb.Tensor(dtype=pb.BF16, shape=list(shape),
                     data=np.ascontiguousarray(bits, dtype="<u2").tobytes())


def read_tensor(t: "pb.Tensor") -> np.ndarray:
    """Tensor -> numpy array of its dtype and shape (bf16 as uint16 bits)."""
    dtypes = {pb.BF16: "<u2", pb.FP16: "<f2", pb.FP32: "<f4", pb.INT32: "<i4", pb.FP8_E4M3: "u1"}
    if t.dtype not in dtypes:
        raise ValueError(f"unsupported tensor dtype {t.dtype}")
    a = np.frombuffer(t.data, dtype=dtypes[t.dtype])
    shape = tuple(t.shape)
    if shape and math.prod(shape) == a.size:
        a = a.reshape(shape)
    return a


def bf16_like(bits: np.ndarray, like: Any) -> Any:
    """bf16 bits returned as the kind the caller gave: a torch bf16 tensor for torch,
    uint16 bits for uint16 bits, ml_dtypes.bfloat16 otherwise."""
    if is_torch(like):
        torch = sys.modules["torch"]
        return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)
    if isinstance(like, np.ndarray) and like.dtype == np.uint16:
        return bits
    return bits.view(BF16)
