"""Float64 numpy reference of DESIGN.md's decode maths, with its own E4M3 rounding.

Independent of the server's code: written from the contract alone.
"""
import numpy as np

E4M3_MAX = 448.0


def e4m3_round(x):
    """Values of float64 `x` rounded to E4M3FN (round to nearest even, saturating at 448)."""
    x = np.asarray(x, dtype=np.float64)
    a = np.minimum(np.abs(x), E4M3_MAX)
    _, e = np.frexp(a)                  # a = m * 2**e, m in [0.5, 1)
    exponent = np.maximum(e - 1, -6)    # below 2**-6 the spacing is the subnormal one
    step = np.ldexp(1.0, exponent - 3)  # 3 mantissa bits
    q = np.minimum(np.rint(a / step) * step, E4M3_MAX)  # np.rint: ties to even
    return np.copysign(q, x)


def bf16_to_f64(bits):
    b = np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16
    return b.view(np.float32).astype(np.float64)


def dequantised(x_bits, scale_mode, scale):
    """What the cache holds for bf16 rows x [..., D]: fp8(x / scale) * scale, float64."""
    x = bf16_to_f64(x_bits).astype(np.float32)
    if scale_mode == "per_token_head":
        amax = np.max(np.abs(x), axis=-1, keepdims=True)
        s = (amax / np.float32(E4M3_MAX)).astype(np.float32)
        s = np.where(s == 0, np.float32(1), s)
    else:
        s = np.float32(scale)
    stored = e4m3_round((x / s).astype(np.float32).astype(np.float64))
    return stored * np.asarray(s, dtype=np.float64)


def decode(q_bits, gate_bits, k_dq, v_dq, indices):
    """q, gate: [Hq, D] bf16 bits; k_dq, v_dq: [T, Hkv, D] dequantised float64;
    indices: [K] or [Hkv, K]. Returns (out [Hq, D], lse [Hq]) float64."""
    q, gate = bf16_to_f64(q_bits), bf16_to_f64(gate_bits)
    hq, d = q.shape
    hkv = k_dq.shape[1]
    g = hq // hkv
    idx = np.asarray(indices)
    out = np.zeros((hq, d))
    lse = np.full(hq, -np.inf)
    for h in range(hq):
        kvh = h // g
        row = idx if idx.ndim == 1 else idx[kvh]
        valid = row[row >= 0]
        if valid.size == 0:
            continue
        s = k_dq[valid, kvh] @ q[h] / np.sqrt(d)
        m = s.max()
        p = np.exp(s - m)
        z = p.sum()
        out[h] = (p / z) @ v_dq[valid, kvh] / (1.0 + np.exp(-gate[h]))
        lse[h] = m + np.log(z)
    return out, lse


def bf16_ulp(x):
    """bf16 spacing at magnitude |x| (normal range)."""
    _, e = np.frexp(np.maximum(np.abs(x), 2.0 ** -126))
    return np.ldexp(1.0, e - 1 - 7)
