"""DecodeClient: the Sparse Decode Server's API as a model runner likes it."""
import dataclasses
import itertools
import threading
from typing import Optional

import grpc
import numpy as np

from ._stubs import pb, pb_grpc
from .layer import LayerCalls
from .tensors import as_bf16_bits, bf16_bits_to_float32, bf16_tensor, int32_tensor, read_tensor


class DecodeError(Exception):
    """A failed call or request: `code` is a grpc.StatusCode, `message` says why."""

    def __init__(self, code, message):
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @classmethod
    def from_rpc(cls, e):
        return cls(e.code(), e.details())

    @classmethod
    def from_int(cls, code, message):
        by_value = {c.value[0]: c for c in grpc.StatusCode}
        return cls(by_value.get(int(code), grpc.StatusCode.UNKNOWN), message)


@dataclasses.dataclass
class DecodeResult:
    request_id: int
    out_bits: np.ndarray            # [Hq, D] uint16, the raw bf16 bits
    lse: Optional[np.ndarray]       # [Hq] float32, natural log; None unless asked for
    batch: dict                     # batch_id, batch_size, queue_us, compute_us

    @property
    def out(self):
        """[Hq, D] float32 (exactly the bf16 values)."""
        return bf16_bits_to_float32(self.out_bits)


def _parse_response(resp):
    if resp.error_code != 0:
        return DecodeError.from_int(resp.error_code, resp.error_message)
    out = read_tensor(resp.out)
    lse = read_tensor(resp.lse) if resp.HasField("lse") and resp.lse.data else None
    b = resp.batch
    batch = dict(batch_id=b.batch_id, batch_size=b.batch_size, queue_us=b.queue_us,
                 compute_us=b.compute_us)
    return DecodeResult(resp.request_id, out, lse, batch)


def _batch_results(resp, count, raise_on_error):
    """A DecodeBatchResponse to `count` requests as decode_batch returns it."""
    # Results are matched to requests by position: a short or long answer would pair
    # outputs with the wrong requests, or drop some silently.
    if len(resp.responses) != count:
        raise DecodeError(grpc.StatusCode.INTERNAL,
                          f"DecodeBatch answered {len(resp.responses)} responses to "
                          f"{count} requests")
    results = [_parse_response(r) for r in resp.responses]
    if raise_on_error:
        for r in results:
            if isinstance(r, DecodeError):
                raise r
    return results


class DecodeBatchFuture:
    """A DecodeBatch call in flight (DecodeClient.decode_batch_async)."""

    def __init__(self, call, count, raise_on_error):
        self._call = call  # grpc's future of the DecodeBatchResponse
        self._count = count
        self._raise_on_error = raise_on_error

    def done(self):
        return self._call.done()

    def cancel(self):
        """Cancels the call if it is still in flight; result() then raises CANCELLED."""
        return self._call.cancel()

    def result(self, timeout=None):
        """Waits up to `timeout` seconds (None: until the call's deadline) and returns
        what decode_batch returns; raises DecodeError as it does, TimeoutError when
        `timeout` passes first (the call goes on)."""
        try:
            resp = self._call.result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise TimeoutError(f"DecodeBatch still in flight after {timeout} s") from None
        except grpc.FutureCancelledError:
            raise DecodeError(grpc.StatusCode.CANCELLED, "DecodeBatch cancelled") from None
        except grpc.RpcError as e:
            raise DecodeError.from_rpc(e) from None
        return _batch_results(resp, self._count, self._raise_on_error)


class DecodeClient(LayerCalls):
    """Connects to a decode server.

    timeout: default deadline in seconds of every call; tenant_id and token are sent as
    `x-tenant-id` and `authorization: Bearer <token>` metadata when given.
    """

    def __init__(self, address, timeout=10.0, tenant_id=None, token=None, channel=None):
        opts = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]
        self._channel = channel or grpc.insecure_channel(address, options=opts)
        self._stub = pb_grpc.DecodeServiceStub(self._channel)
        self.timeout = timeout
        self._metadata = []
        if tenant_id:
            self._metadata.append(("x-tenant-id", tenant_id))
        if token:
            self._metadata.append(("authorization", f"Bearer {token}"))
        self._info = None
        self._ids = itertools.count(1)
        self._ids_lock = threading.Lock()
        self._regions = []  # registered by this client, for decode_layer's references

    def close(self):
        for region in list(self._regions):
            try:
                region.close()
            except DecodeError:
                pass  # the server may be gone already
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _options(self, timeout):
        """The deadline (this call's, else the client's) and metadata of a call."""
        return {"timeout": timeout or self.timeout, "metadata": self._metadata}

    def _call(self, method, request, timeout):
        try:
            return method(request, **self._options(timeout))
        except grpc.RpcError as e:
            raise DecodeError.from_rpc(e) from None

    def next_request_id(self):
        with self._ids_lock:
            return next(self._ids)

    # -- model and sequences ---------------------------------------------------------
    def model_info(self, timeout=None):
        self._info = self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)
        return self._info

    @property
    def shape(self):
        """(num_q_heads, num_kv_heads, head_dim), fetched once."""
        if self._info is None:
            self.model_info()
        i = self._info
        return i.num_q_heads, i.num_kv_heads, i.head_dim

    def create_sequence(self, sequence_id, reserve_tokens=0, timeout=None):
        req = pb.CreateSequenceRequest(sequence_id=sequence_id, reserve_tokens=reserve_tokens)
        return self._call(self._stub.CreateSequence, req, timeout).reserved_pages

    def append_kv(self, sequence_id, layer, start, k, v, timeout=None):
        """k, v: [n, Hkv, D] (or [Hkv, D] for one token), bf16 bits or float. Returns length."""
        _, hkv, d = self.shape
        kb, vb = as_bf16_bits(k, "k"), as_bf16_bits(v, "v")
        if kb.shape != vb.shape or kb.size % (hkv * d) != 0:
            raise ValueError(f"k {kb.shape} and v {vb.shape} must both be [n, {hkv}, {d}]")
        n = kb.size // (hkv * d)
        req = pb.AppendKVRequest(sequence_id=sequence_id, layer=layer, start_position=start,
                                 k=bf16_tensor(kb, (n, hkv, d)), v=bf16_tensor(vb, (n, hkv, d)))
        return self._call(self._stub.AppendKV, req, timeout).length

    def fork_sequence(self, sequence_id, new_sequence_id, timeout=None):
        req = pb.ForkSequenceRequest(sequence_id=sequence_id, new_sequence_id=new_sequence_id)
        self._call(self._stub.ForkSequence, req, timeout)

    def release_sequence(self, sequence_id, timeout=None):
        req = pb.ReleaseSequenceRequest(sequence_id=sequence_id)
        return self._call(self._stub.ReleaseSequence, req, timeout).freed_pages

    # -- decode ----------------------------------------------------------------------
    def make_request(self, sequence_id, layer, position, q, k, v, gate, indices,
                     return_lse=False, request_id=0):
        """Builds a DecodeRequest. q, gate: [Hq, D]; k, v: [Hkv, D]; indices: [K] or [Hkv, K]."""
        hq, hkv, d = self.shape
        arrays = {"q": (q, (hq, d)), "gate": (gate, (hq, d)), "k": (k, (hkv, d)),
                  "v": (v, (hkv, d))}
        tensors = {}
        for name, (a, shape) in arrays.items():
            bits = as_bf16_bits(a, name)
            if bits.size != shape[0] * shape[1]:
                raise ValueError(f"{name} has {bits.size} elements, the model needs {shape}")
            tensors[name] = bf16_tensor(bits, shape)
        return pb.DecodeRequest(sequence_id=sequence_id, layer=layer, position=position,
                                indices=int32_tensor(indices), return_lse=return_lse,
                                request_id=request_id, **tensors)

    def decode(self, sequence_id, layer, position, q, k, v, gate, indices, return_lse=False,
               request_id=0, timeout=None):
        """One token, one layer. Returns DecodeResult; raises DecodeError."""
        req = self.make_request(sequence_id, layer, position, q, k, v, gate, indices,
                                return_lse, request_id)
        res = _parse_response(self._call(self._stub.Decode, req, timeout))
        if isinstance(res, DecodeError):
            raise res
        return res

    def decode_batch(self, requests, timeout=None, raise_on_error=False):
        """requests: DecodeRequest protos or dicts of decode()'s arguments.

        Returns a list in the same order of DecodeResult, or DecodeError for a request
        that failed alone (raised instead when raise_on_error). Raises DecodeError
        (INTERNAL) when the server answers a different number of responses.
        """
        reqs = self._batch_requests(requests)
        resp = self._call(self._stub.DecodeBatch, pb.DecodeBatchRequest(requests=reqs), timeout)
        return _batch_results(resp, len(reqs), raise_on_error)

    def decode_batch_async(self, requests, timeout=None, raise_on_error=False):
        """decode_batch without waiting: returns a DecodeBatchFuture at once, so that one
        thread can keep several calls in flight (micro-batches, pipeline stages; one call
        at a time leaves the server idle for every round trip). Its result() returns or
        raises what decode_batch would."""
        reqs = self._batch_requests(requests)
        call = self._stub.DecodeBatch.future(pb.DecodeBatchRequest(requests=reqs),
                                             **self._options(timeout))
        return DecodeBatchFuture(call, len(reqs), raise_on_error)

    def _batch_requests(self, requests):
        return [r if isinstance(r, pb.DecodeRequest) else self.make_request(**r) for r in requests]

    # -- shared-memory regions (the server runs with --allow_client_shm) ------------------
    def register_system_region(self, name, byte_size):
        """Creates `byte_size` bytes of POSIX shared memory and registers them as `name`.
        Returns a SystemRegion: .numpy(shape, dtype) / .torch(shape, dtype) give views
        that decode_layer sends by reference; .close() unregisters and frees it."""
        from .regions import SystemRegion
        return SystemRegion(self, name, byte_size)

    def register_cuda_region(self, name, tensor):
        """Registers a contiguous torch CUDA tensor's memory (CUDA IPC) as `name`.
        Returns a CudaRegion: tensors inside it (.torch(shape, dtype)) travel by
        reference, read and written by the server on the GPU."""
        from .regions import CudaRegion
        return CudaRegion(self, name, tensor)

    def list_regions(self, timeout=None):
        """This tenant's regions on the server: a list of dicts (name, kind, byte_size,
        calls_in_flight)."""
        resp = self._call(self._stub.ListRegions, pb.ListRegionsRequest(), timeout)
        return [dict(name=r.name, kind=r.kind, byte_size=r.byte_size,
                     calls_in_flight=r.calls_in_flight) for r in resp.regions]

    def _remember_region(self, region):
        self._regions.append(region)

    def _forget_region(self, region):
        if region in self._regions:
            self._regions.remove(region)

    def stream(self, timeout=None):
        """Opens a DecodeStream (see DecodeStream); `timeout` bounds its whole life."""
        from .stream import DecodeStream
        return DecodeStream(self, timeout)
