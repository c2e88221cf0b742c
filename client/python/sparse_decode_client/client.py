"""DecodeClient: the Sparse Decode Server's API as a model runner likes it (synchronous;
aio.py has the asyncio one). Arguments after the first are keyword-only: q/gate and k/v
have the same shapes, and a swapped pair would be a silent wrong answer."""
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

import grpc

from ._stubs import pb, pb_grpc
from .core import CHANNEL_OPTIONS, KV, ClientCore, not_ready, ready_retryable
from .errors import DecodeError, first_error
from .layer import LayerResult
from .results import DecodeResult, batch_results, not_found, parse_response
from .sequence import SequenceScope
from .tensors import ArrayLike

Request = Union["pb.DecodeRequest", Dict[str, Any]]
BatchResults = List[Union[DecodeResult, DecodeError]]


class DecodeBatchFuture:
    """A DecodeBatch call in flight (DecodeClient.decode_batch_async)."""

    def __init__(self, call, sequence_ids: List[str], raise_on_error: bool):
        self._call = call  # grpc's future of the DecodeBatchResponse
        self._sequence_ids = sequence_ids
        self._raise_on_error = raise_on_error

    def done(self) -> bool:
        return self._call.done()

    def cancel(self) -> bool:
        """Cancels the call if it is still in flight; result() then raises CANCELLED."""
        return self._call.cancel()

    def result(self, timeout: Optional[float] = None) -> BatchResults:
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
        return batch_results(resp, self._sequence_ids, self._raise_on_error)


class DecodeClient(ClientCore):
    """Connects to a decode server.

    timeout: default deadline in seconds of every call; tenant_id and token are sent as
    `x-tenant-id` and `authorization: Bearer <token>` metadata when given.
    """

    def __init__(self, address: str, *, timeout: float = 10.0, tenant_id: Optional[str] = None,
                 token: Optional[str] = None, channel: Optional[grpc.Channel] = None):
        self._init_core(address, timeout, tenant_id, token)
        self._channel = channel or grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.DecodeServiceStub(self._channel)

    def close(self) -> None:
        for region in list(self._regions):
            try:
                region.close()
            except DecodeError:
                pass  # the server may be gone already
        self._channel.close()

    def __enter__(self) -> "DecodeClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, method, request, timeout, wait_for_ready=None):
        try:
            return method(request, **self._options(timeout, wait_for_ready))
        except grpc.RpcError as e:
            raise DecodeError.from_rpc(e) from None

    # -- model and sequences ---------------------------------------------------------
    def model_info(self, *, timeout: Optional[float] = None, wait_for_ready: bool = False):
        self._info = self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout,
                                wait_for_ready)
        return self._info

    def wait_until_ready(self, timeout: float = 30.0):
        """Waits until the server answers (it listens only once its self-test passed, and
        answers UNAVAILABLE while draining) and returns its ModelInfo; raises DecodeError
        (DEADLINE_EXCEEDED) after `timeout` seconds, at once on other errors."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                return self.model_info(timeout=max(left, 0.01), wait_for_ready=True)
            except DecodeError as e:
                if not ready_retryable(e):
                    raise
                if time.monotonic() + 0.05 >= deadline:
                    raise not_ready(self.address, timeout, e) from None
            time.sleep(0.05)

    @property
    def shape(self):
        """(num_q_heads, num_kv_heads, head_dim), fetched once."""
        if self._info is None:
            self.model_info()
        return self.known_shape

    def create_sequence(self, sequence_id: str, *, reserve_tokens: int = 0,
                        timeout: Optional[float] = None) -> int:
        """Returns the pages reserved."""
        req = pb.CreateSequenceRequest(sequence_id=sequence_id, reserve_tokens=reserve_tokens)
        return self._call(self._stub.CreateSequence, req, timeout).reserved_pages

    def append_kv(self, sequence_id: str, *, layer: int, start: int, k: ArrayLike, v: ArrayLike,
                  timeout: Optional[float] = None) -> int:
        """Writes k, v ([n, Hkv, D], or [Hkv, D] for one token; bf16 or floats rounded to
        bf16) at positions start..start+n-1 of `layer`. Returns the layer's length."""
        req = self._append_request(sequence_id, layer, start, k, v)
        return self._call(self._stub.AppendKV, req, timeout).length

    def fork_sequence(self, sequence_id: str, new_sequence_id: str, *,
                      timeout: Optional[float] = None) -> None:
        req = pb.ForkSequenceRequest(sequence_id=sequence_id, new_sequence_id=new_sequence_id)
        self._call(self._stub.ForkSequence, req, timeout)

    def release_sequence(self, sequence_id: str, *, timeout: Optional[float] = None) -> int:
        """Frees the sequence's pages at once; returns how many."""
        req = pb.ReleaseSequenceRequest(sequence_id=sequence_id)
        return self._call(self._stub.ReleaseSequence, req, timeout).freed_pages

    def sequence(self, sequence_id: str, *, reserve_tokens: int = 0) -> SequenceScope:
        """`with client.sequence(id) as seq:` creates the sequence and releases it on exit."""
        return SequenceScope(self, sequence_id, reserve_tokens)

    def reprefill(self, sequence_id: str, *, kv: KV, reserve_tokens: Optional[int] = None,
                  timeout: Optional[float] = None) -> None:
        """Creates `sequence_id` again (after the server answered NOT_FOUND: a restart, an
        idle expiry) and writes the K/V the runner kept, kv[layer] = (k, v) of shape
        [T, Hkv, D], from position 0. Tolerates a sequence that exists already."""
        reserve = self._reserve_for(kv) if reserve_tokens is None else reserve_tokens
        try:
            self.create_sequence(sequence_id, reserve_tokens=reserve, timeout=timeout)
        except DecodeError as e:
            if e.code != grpc.StatusCode.ALREADY_EXISTS:
                raise
        for req in self._reprefill_requests(sequence_id, kv):
            self._call(self._stub.AppendKV, req, timeout)

    # -- decode ----------------------------------------------------------------------
    def decode(self, sequence_id: str, *, layer: int, position: int, q: ArrayLike, k: ArrayLike,
               v: ArrayLike, gate: ArrayLike, indices: Any, return_lse: bool = False,
               request_id: int = 0, timeout: Optional[float] = None) -> DecodeResult:
        """One token, one layer: q, gate [Hq, D], k, v [Hkv, D], indices [K] or [Hkv, K].
        Returns DecodeResult; raises DecodeError."""
        req = self.make_request(sequence_id, layer=layer, position=position, q=q, k=k, v=v,
                                gate=gate, indices=indices, return_lse=return_lse,
                                request_id=request_id)
        res = parse_response(self._call(self._stub.Decode, req, timeout))
        first_error([res])
        return res

    def decode_batch(self, requests: Sequence[Request], *, timeout: Optional[float] = None,
                     raise_on_error: bool = True) -> BatchResults:
        """requests: DecodeRequest protos or dicts of decode()'s arguments.

        Returns a list of DecodeResult in the same order. A failed item raises its
        DecodeError (with .index and .sequence_id); with raise_on_error=False it takes
        that item's place in the list instead. Raises DecodeError (INTERNAL) when the
        server answers a different number of responses.
        """
        batch, seqs = self._batch_request(requests)
        resp = self._call(self._stub.DecodeBatch, batch, timeout)
        return batch_results(resp, seqs, raise_on_error)

    def decode_batch_async(self, requests: Sequence[Request], *, timeout: Optional[float] = None,
                           raise_on_error: bool = True) -> DecodeBatchFuture:
        """decode_batch without waiting: returns a DecodeBatchFuture at once, so that one
        thread can keep several calls in flight (micro-batches, pipeline stages; one call
        at a time leaves the server idle for every round trip). Its result() returns or
        raises what decode_batch would."""
        batch, seqs = self._batch_request(requests)
        call = self._stub.DecodeBatch.future(batch, **self._options(timeout))
        return DecodeBatchFuture(call, seqs, raise_on_error)

    def decode_layer(self, *, layer: int, sequence_ids: Sequence[str], positions: Sequence[int],
                     q: ArrayLike, gate: ArrayLike, k: ArrayLike, v: ArrayLike, indices: Any,
                     topk: Optional[Sequence[int]] = None, out: Any = None, lse: Any = None,
                     return_lse: bool = False, request_id: Optional[int] = None,
                     timeout: Optional[float] = None, raise_on_error: bool = True,
                     on_not_found: Optional[Callable[[str], KV]] = None) -> LayerResult:
        """One layer's decode step for B sequences in one call, over [B, ...] arrays.

        q, gate: [B, Hq, D] bf16; k, v: [B, Hkv, D] bf16 (each item's new token, written
        at positions[b]); indices: [B, K] or [B, Hkv, K] int32, -1 = skip; topk: optional
        [B] ints, the used prefix of each item's list. bf16 is torch.bfloat16,
        ml_dtypes.bfloat16 or uint16 bits; shapes and dtypes must match exactly, nothing
        is reshaped or converted. out ([B, Hq, D] bf16) and lse ([B, Hq] float32) receive
        the outputs when given. Tensors inside a registered region travel by reference
        (the server writes out there), the others as bytes.

        Returns LayerResult. Raises DecodeError for a bad call, and for the first failed
        item unless raise_on_error=False (then see LayerResult.errors). on_not_found:
        sequence_id -> the K/V the runner kept for it ({layer: (k, v)}, [T, Hkv, D]); when
        given, items answered NOT_FOUND have their sequences re-prefilled from it and the
        call is sent once more (writes are idempotent: the other items give the same bits).
        """
        req, ctx = self._layer_request(
            layer=layer, sequence_ids=sequence_ids, positions=positions, q=q, gate=gate, k=k,
            v=v, indices=indices, topk=topk, out=out, lse=lse, return_lse=return_lse,
            request_id=request_id)
        res = self._layer_result(self._call(self._stub.DecodeLayer, req, timeout), ctx)
        lost = not_found(res.errors)
        if on_not_found is not None and lost:
            for seq in dict.fromkeys(ctx["sequence_ids"][i] for i in lost):
                self.reprefill(seq, kv=on_not_found(seq), timeout=timeout)
            res = self._layer_result(self._call(self._stub.DecodeLayer, req, timeout), ctx)
        if raise_on_error:
            first_error(res.errors)
        return res

    def layer_stream(self, timeout: Optional[float] = None):
        """Opens a DecodeLayerStream: send() takes decode_layer's arguments and returns a
        request_id at once, result(request_id) gives that message's LayerResult, so that
        several layer steps (micro-batches) are in flight on one stream."""
        from .stream import LayerStream
        return LayerStream(self, timeout)

    def stream(self, timeout: Optional[float] = None):
        """Opens a DecodeStream (see DecodeStream); `timeout` bounds its whole life."""
        from .stream import DecodeStream
        return DecodeStream(self, timeout)

    # -- shared-memory regions (the server runs with --allow_client_shm) ------------------
    def register_system_region(self, name: str, byte_size: int):
        """Creates `byte_size` bytes of POSIX shared memory and registers them as `name`.
        Returns a SystemRegion: .numpy(shape, dtype) / .torch(shape, dtype) give views
        that decode_layer sends by reference; .close() unregisters and frees it."""
        from .regions import SystemRegion
        return SystemRegion(self, name, byte_size)

    def register_cuda_region(self, name: str, tensor):
        """Registers a contiguous torch CUDA tensor's memory (CUDA IPC) as `name`.
        Returns a CudaRegion: tensors inside it (.torch(shape, dtype)) travel by
        reference, read and written by the server on the GPU."""
        from .regions import CudaRegion
        return CudaRegion(self, name, tensor)

    def list_regions(self, *, timeout: Optional[float] = None) -> List[dict]:
        """This tenant's regions on the server: a list of dicts (name, kind, byte_size,
        calls_in_flight)."""
        resp = self._call(self._stub.ListRegions, pb.ListRegionsRequest(), timeout)
        return [dict(name=r.name, kind=r.kind, byte_size=r.byte_size,
                     calls_in_flight=r.calls_in_flight) for r in resp.regions]

    def _remember_region(self, region) -> None:
        self._regions.append(region)

    def _forget_region(self, region) -> None:
        if region in self._regions:
            self._regions.remove(region)
