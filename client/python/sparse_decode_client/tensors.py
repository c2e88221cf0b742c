"""bf16 conversions and Tensor packing (raw little-endian C-contiguous bytes)."""
import numpy as np

from ._stubs import pb


def float32_to_bf16_bits(x):
    """float32 (or anything castable) -> bf16 bits as uint16, round to nearest even.

    NaN stays NaN (quiet); +-Inf stays Inf; overflow rounds to Inf as IEEE says.
    """
    f = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    u = f.view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(f)
    out = rounded.astype(np.uint16)
    if nan.any():
        out[nan] = ((u[nan] >> 16) | 0x0040).astype(np.uint16)
    return out


def bf16_bits_to_float32(bits):
    b = np.ascontiguousarray(np.asarray(bits, dtype=np.uint16))
    return (b.astype(np.uint32) << 16).view(np.float32)


def as_bf16_bits(x, name="tensor"):
    """Accepts uint16 (already bf16 bits) or a floating array (converted with RNE)."""
    a = np.asarray(x)
    if a.dtype == np.uint16:
        return np.ascontiguousarray(a)
    if np.issubdtype(a.dtype, np.floating):
        return float32_to_bf16_bits(a)
    raise TypeError(f"{name}: expected bf16 bits (uint16) or a float array, got {a.dtype}")


def bf16_tensor(bits, shape):
    t = pb.Tensor(dtype=pb.BF16, shape=list(shape))
    t.data = np.ascontiguousarray(bits, dtype="<u2").tobytes()
    return t


INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def int32_tensor(values, name="indices"):
    """Integers -> INT32 Tensor. Values outside int32 are rejected, not wrapped: a cast
    would turn 2**32 - 1 into -1, which the server reads as "skip"."""
    a = np.asarray(values)
    if a.size == 0:
        a = a.astype(np.int32)  # np.asarray([]) is float64
    if not np.issubdtype(a.dtype, np.integer):  # floats would be truncated, bools are no indices
        raise TypeError(f"{name}: expected integers, got {a.dtype}")
    if a.size and (int(a.min()) < INT32_MIN or int(a.max()) > INT32_MAX):
        bad = next(int(x) for x in a.flat if not INT32_MIN <= int(x) <= INT32_MAX)
        raise ValueError(f"{name}: {bad} is outside int32 [{INT32_MIN}, {INT32_MAX}]")
    a = np.ascontiguousarray(a, dtype="<i4")
    return pb.Tensor(dtype=pb.INT32, shape=list(a.shape), data=a.tobytes())


def read_tensor(t):
    """Tensor -> numpy array of its dtype and shape (bf16 as uint16 bits)."""
    dtypes = {pb.BF16: "<u2", pb.FP16: "<f2", pb.FP32: "<f4", pb.INT32: "<i4", pb.FP8_E4M3: "u1"}
    if t.dtype not in dtypes:
        raise ValueError(f"unsupported tensor dtype {t.dtype}")
    a = np.frombuffer(t.data, dtype=dtypes[t.dtype])
    shape = tuple(t.shape)
    if shape and int(np.prod(shape)) == a.size:
        a = a.reshape(shape)
    return a
