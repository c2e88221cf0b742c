"""What the synchronous and the asyncio client share: call options, the model's shape and
the requests built from a caller's arrays (shapes checked exactly, nothing reshaped)."""
import itertools
import threading
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import grpc

from ._stubs import pb
from .errors import DecodeError
from .layer import LayerCalls
from .tensors import ArrayLike, bf16_bits, bf16_data, int32_array, shape_error

# Unlimited on the client: a long prefill is one big AppendKV (the server caps its side).
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
KV = Mapping[int, Tuple[ArrayLike, ArrayLike]]  # layer -> (k, v), each [T, Hkv, D]
REPREFILL_CHUNK_TOKENS = 1024  # AppendKV rows per message when re-prefilling


def ready_retryable(e: DecodeError) -> bool:
    """Whether wait_until_ready tries again after `e`: the server is not up yet (or still
    starting: it listens only after its self-test), or draining."""
    return e.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def not_ready(address: str, timeout: float, e: DecodeError) -> DecodeError:
    return DecodeError(grpc.StatusCode.DEADLINE_EXCEEDED,
                       f"server {address} not ready within {timeout} s (last: {e})")


class ClientCore(LayerCalls):
    """State and request building of DecodeClient and AsyncDecodeClient (no transport)."""

    def _init_core(self, address: str, timeout: float, tenant_id: Optional[str],
                   token: Optional[str]) -> None:
        self.address = address
        self.timeout = timeout
        self._metadata: List[Tuple[str, str]] = []
        if tenant_id:
            self._metadata.append(("x-tenant-id", tenant_id))
        if token:
            self._metadata.append(("authorization", f"Bearer {token}"))
        self._info = None
        self._ids = itertools.count(1)
        self._ids_lock = threading.Lock()
        self._regions: list = []  # registered by this client, for decode_layer's references

    def _options(self, timeout: Optional[float], wait_for_ready: Optional[bool] = None) -> dict:
        """The deadline (this call's, else the client's) and metadata of a call."""
        opts = {"timeout": timeout or self.timeout, "metadata": self._metadata}
        if wait_for_ready is not None:
            opts["wait_for_ready"] = wait_for_ready
        return opts

    def next_request_id(self) -> int:
        with self._ids_lock:
            return next(self._ids)

    @property
    def known_shape(self) -> Tuple[int, int, int]:
        """(num_q_heads, num_kv_heads, head_dim) of the last model_info()."""
        if self._info is None:
            raise RuntimeError("the model's shape is not known yet: call model_info() first")
        i = self._info
        return i.num_q_heads, i.num_kv_heads, i.head_dim

    # -- requests ----------------------------------------------------------------------
    def _append_request(self, sequence_id: str, layer: int, start: int, k: ArrayLike,
                        v: ArrayLike) -> "pb.AppendKVRequest":
        """k, v: [n, Hkv, D] (or [Hkv, D] for one token), the same shape."""
        _, hkv, d = self.shape
        kb, vb = bf16_bits(k, "k"), bf16_bits(v, "v")
        if kb.ndim == 2:
            want, layout = (hkv, d), "[Hkv, D]"
        else:
            n = kb.size // (hkv * d) if kb.size % (hkv * d) == 0 else kb.shape[0]
            want, layout = (n, hkv, d), "[n, Hkv, D]"
        for name, bits in (("k", kb), ("v", vb)):
            if bits.shape != want:
                raise shape_error(name, bits.shape, want, layout)
        rows = (1,) + want if len(want) == 2 else want
        return pb.AppendKVRequest(
            sequence_id=sequence_id, layer=layer, start_position=start,
            k=pb.Tensor(dtype=pb.BF16, shape=rows, data=kb.tobytes()),
            v=pb.Tensor(dtype=pb.BF16, shape=rows, data=vb.tobytes()))

    def _fill_request(self, msg: "pb.DecodeRequest", sequence_id: str, layer: int,
                      position: int, q: ArrayLike, k: ArrayLike, v: ArrayLike, gate: ArrayLike,
                      indices: Any, return_lse: bool = False, request_id: int = 0) -> None:
        """Writes one decode item into `msg` (in place: cheaper than building and copying)."""
        hq, hkv, d = self.shape
        msg.sequence_id, msg.layer, msg.position = sequence_id, layer, position
        msg.return_lse, msg.request_id = return_lse, request_id
        for name, x, rows, layout in (("q", q, hq, "[Hq, D]"), ("k", k, hkv, "[Hkv, D]"),
                                      ("v", v, hkv, "[Hkv, D]"), ("gate", gate, hq, "[Hq, D]")):
            t = getattr(msg, name)
            t.dtype = pb.BF16
            t.shape[:] = (rows, d)
            t.data = bf16_data(x, name, (rows, d), layout)
        idx = int32_array(indices)
        if not (idx.ndim == 1 or (idx.ndim == 2 and idx.shape[0] == hkv)):
            raise ValueError(f"indices: shape must be [K] or [Hkv, K] = [K] or [{hkv}, K], got "
                             f"{list(idx.shape)}")
        msg.indices.dtype = pb.INT32
        msg.indices.shape[:] = idx.shape
        msg.indices.data = idx.tobytes()

    def make_request(self, sequence_id: str, *, layer: int, position: int, q: ArrayLike,
                     k: ArrayLike, v: ArrayLike, gate: ArrayLike, indices: Any,
                     return_lse: bool = False, request_id: int = 0) -> "pb.DecodeRequest":
        """A DecodeRequest. q, gate: [Hq, D]; k, v: [Hkv, D] bf16; indices: [K] or [Hkv, K]."""
        msg = pb.DecodeRequest()
        self._fill_request(msg, sequence_id, layer, position, q, k, v, gate, indices,
                           return_lse, request_id)
        return msg

    def _batch_request(self, requests: Sequence[Union["pb.DecodeRequest", Dict[str, Any]]]
                       ) -> Tuple["pb.DecodeBatchRequest", List[str]]:
        batch = pb.DecodeBatchRequest()
        for r in requests:
            if isinstance(r, pb.DecodeRequest):
                batch.requests.append(r)
            else:
                self._fill_request(batch.requests.add(), **r)
        return batch, [r.sequence_id for r in batch.requests]

    def _reprefill_requests(self, sequence_id: str, kv: KV) -> Iterator["pb.AppendKVRequest"]:
        """AppendKV requests writing every layer's kept K/V from position 0."""
        for layer in sorted(kv):
            k, v = kv[layer]
            kb, vb = bf16_bits(k, "k"), bf16_bits(v, "v")
            for start in range(0, len(kb), REPREFILL_CHUNK_TOKENS):
                end = start + REPREFILL_CHUNK_TOKENS
                yield self._append_request(sequence_id, layer, start, kb[start:end], vb[start:end])

    @staticmethod
    def _reserve_for(kv: KV) -> int:
        return max((len(k) for k, _ in kv.values()), default=0)
