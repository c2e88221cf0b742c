"""DecodeLayer: one layer's packed batch in one call, tensors by region reference where
they lie in a registered region (regions.py) and as bytes otherwise."""
import dataclasses
from typing import List, Optional

import numpy as np

from ._stubs import pb
from .errors import DecodeError
from .regions import address_of
from .results import batch_info
from .tensors import bf16_like, check_shape, is_torch, torch_to_numpy

_BF16, _INT32, _FP32 = "bf16", "int32", "fp32"
_PB_DTYPE = {_BF16: pb.BF16, _INT32: pb.INT32, _FP32: pb.FP32}


@dataclasses.dataclass
class LayerResult:
    out: object                 # [B, Hq, D] bf16: the caller's `out`, or a new array/tensor
    lse: Optional[object]       # [B, Hq] float32 when asked for
    errors: List[Optional[Exception]]  # per item: None, or the item's DecodeError
    batch: dict                 # BatchInfo of the last batch that ran an item

    @property
    def ok(self):
        return all(e is None for e in self.errors)


def _kind(array):
    """The element type of a numpy array or torch tensor, as this module names it."""
    if isinstance(array, np.ndarray):
        if array.dtype == np.uint16 or array.dtype.name == "bfloat16":  # bits, or ml_dtypes
            return _BF16
        if array.dtype == np.int32:
            return _INT32
        if array.dtype == np.float32:
            return _FP32
        return str(array.dtype)
    if hasattr(array, "dtype") and hasattr(array, "data_ptr"):
        import torch
        return {torch.bfloat16: _BF16, torch.int32: _INT32, torch.float32: _FP32}.get(
            array.dtype, str(array.dtype))
    raise TypeError(f"expected a numpy array or a torch tensor, got {type(array).__name__}")


def _check(name, array, kind, shape, layout):
    got = _kind(array)
    if got != kind:
        hint = ""
        if kind == _BF16:
            hint = (" (convert first: torch .to(torch.bfloat16), ml_dtypes.bfloat16, or "
                    "float32_to_bf16_bits for uint16 bits)")
        raise TypeError(f"{name}: dtype must be {kind}, got {got}{hint}")
    check_shape(name, array, shape, layout)


def _bytes(name, array):
    if isinstance(array, np.ndarray):
        return np.ascontiguousarray(array).tobytes()
    return torch_to_numpy(array, name).tobytes()


class LayerCalls:
    """DecodeLayer's requests and answers, mixed into the clients (which send them)."""

    def _region_for(self, array):
        loc = address_of(array)
        if loc is None:
            return None
        address, nbytes, device = loc
        for region in self._regions:
            if (region.kind == "cuda") == (device == "cuda") and region.contains(address, nbytes):
                return region.ref(address, nbytes)
        return None

    def _packed(self, dest, name, array, kind, shape, layout, output=False):
        """Fills the PackedTensor `dest` (in place: no copy of the bytes) with a reference
        or the bytes of `array`; returns whether it went by reference. An output outside
        every region stays unset: it comes back inline and is copied into `array`."""
        _check(name, array, kind, shape, layout)
        ref = self._region_for(array)
        if ref is None and output:
            return False
        if ref is None and getattr(array, "is_cuda", False):
            raise ValueError(f"{name}: a CUDA tensor outside every registered CUDA region "
                             "(register_cuda_region its memory first)")
        dest.dtype = _PB_DTYPE[kind]
        dest.shape[:] = shape
        if ref is not None:
            dest.ref.CopyFrom(ref)
            return True
        dest.data = _bytes(name, array)
        return False

    def _layer_request(self, *, layer, sequence_ids, positions, q, gate, k, v, indices, topk=None,
                       out=None, lse=None, return_lse=False, request_id=None):
        """The DecodeLayerRequest of decode_layer's arguments (DecodeClient.decode_layer
        says what they are), and what its answer needs."""
        hq, hkv, d = self.shape
        b = len(sequence_ids)
        if len(positions) != b:
            raise ValueError(f"positions has {len(positions)} values for {b} sequence_ids")
        per_head = len(getattr(indices, "shape", ())) == 3
        kk = indices.shape[-1] if len(getattr(indices, "shape", ())) >= 2 else 0
        req = pb.DecodeLayerRequest(layer=layer, sequence_ids=list(sequence_ids),
                                    positions=[int(p) for p in positions],
                                    return_lse=bool(return_lse or lse is not None),
                                    request_id=request_id or self.next_request_id())
        if topk is not None:
            req.topk.extend(int(t) for t in topk)
        any_cuda = False
        for name, array, shape, layout in (("q", q, (b, hq, d), "[B, Hq, D]"),
                                           ("gate", gate, (b, hq, d), "[B, Hq, D]"),
                                           ("k", k, (b, hkv, d), "[B, Hkv, D]"),
                                           ("v", v, (b, hkv, d), "[B, Hkv, D]")):
            by_ref = self._packed(getattr(req, name), name, array, _BF16, shape, layout)
            any_cuda |= by_ref and getattr(array, "is_cuda", False)
        idx_shape = (b, hkv, kk) if per_head else (b, kk)
        by_ref = self._packed(req.indices, "indices", indices, _INT32, idx_shape,
                              "[B, Hkv, K]" if per_head else "[B, K]")
        any_cuda |= by_ref and getattr(indices, "is_cuda", False)
        out_by_ref = lse_by_ref = False
        if out is not None:
            out_by_ref = self._packed(req.out, "out", out, _BF16, (b, hq, d), "[B, Hq, D]",
                                      output=True)
        if lse is not None:
            lse_by_ref = self._packed(req.lse, "lse", lse, _FP32, (b, hq), "[B, Hq]", output=True)
        if any_cuda:
            import torch
            torch.cuda.current_stream().synchronize()  # the server reads on its own stream
        ctx = dict(b=b, shape=(hq, d), sequence_ids=list(sequence_ids), out=out,
                   out_by_ref=out_by_ref, lse=lse, lse_by_ref=lse_by_ref, like=q,
                   return_lse=req.return_lse)
        return req, ctx

    def _layer_result(self, resp, ctx):
        """LayerResult of a DecodeLayerResponse; per-item errors in .errors, not raised."""
        if resp.error_code != 0:  # a stream message refused whole
            raise DecodeError.from_int(resp.error_code, resp.error_message)
        b, (hq, d) = ctx["b"], ctx["shape"]
        if len(resp.error_codes) != b:
            raise DecodeError.from_int(13, f"the server answered {len(resp.error_codes)} "
                                           f"items for {b}")
        seqs = ctx["sequence_ids"]
        errors = [None if c == 0 else DecodeError.from_int(c, m, index=i, sequence_id=seqs[i])
                  for i, (c, m) in enumerate(zip(resp.error_codes, resp.error_messages))]
        out = self._deliver(ctx["out"], ctx["out_by_ref"], resp.out, "<u2", (b, hq, d), ctx["like"])
        lse = None
        if ctx["return_lse"]:
            lse = self._deliver(ctx["lse"], ctx["lse_by_ref"], resp.lse, "<f4", (b, hq), None)
        return LayerResult(out, lse, errors, batch_info(resp.batch))

    @staticmethod
    def _deliver(dest, by_ref, tensor, np_dtype, shape, like):
        """The output as the caller gets it: `dest` (written by the server, or filled
        here from the inline bytes), else a new array (a torch tensor when `like` is)."""
        if by_ref:
            return dest
        values = np.frombuffer(tensor.data, dtype=np_dtype).reshape(shape)
        if dest is None:
            if like is None:
                return values.copy()
            out = bf16_like(values.copy(), like)
            return out.to(like.device) if is_torch(like) else out
        if isinstance(dest, np.ndarray):
            dest[...] = values.view(dest.dtype)
            return dest
        import torch
        src = torch.from_numpy(values.copy().view(np.int16 if np_dtype == "<u2" else np.float32))
        if np_dtype == "<u2":
            src = src.view(torch.bfloat16)
        dest.copy_(src.to(dest.device))
        return dest

