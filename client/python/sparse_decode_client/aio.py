"""AsyncDecodeClient: DecodeClient's calls on a grpc.aio channel, for asyncio runners.

The same arguments and checks as DecodeClient (core.py builds the requests); each call
is a coroutine. Tensors travel as bytes: shared-memory regions are DecodeClient's.
"""
import asyncio
from typing import Any, Callable, Optional, Sequence

import grpc

from ._stubs import pb, pb_grpc
from .client import BatchResults, Request
from .core import CHANNEL_OPTIONS, KV, ClientCore, not_ready, ready_retryable
from .errors import DecodeError, first_error
from .layer import LayerResult
from .results import DecodeResult, batch_results, not_found, parse_response
from .sequence import SequenceScope
from .tensors import ArrayLike


class AsyncDecodeClient(ClientCore):
    """    async with AsyncDecodeClient("127.0.0.1:50051") as c:
            await c.wait_until_ready()
            res = await c.decode_layer(layer=0, sequence_ids=ids, positions=pos, q=q, ...)

    Calls that build tensors need the model's shape: call model_info() or
    wait_until_ready() first (async with does it)."""

    def __init__(self, address: str, *, timeout: float = 10.0, tenant_id: Optional[str] = None,
                 token: Optional[str] = None, channel: Optional[grpc.aio.Channel] = None):
        self._init_core(address, timeout, tenant_id, token)
        self._channel = channel or grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = pb_grpc.DecodeServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> "AsyncDecodeClient":
        await self.model_info(wait_for_ready=True)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _call(self, method, request, timeout, wait_for_ready=None):
        try:
            return await method(request, **self._options(timeout, wait_for_ready))
        except grpc.RpcError as e:
            raise DecodeError.from_rpc(e) from None

    @property
    def shape(self):
        """(num_q_heads, num_kv_heads, head_dim) of the last model_info()."""
        return self.known_shape

    # -- model and sequences ---------------------------------------------------------
    async def model_info(self, *, timeout: Optional[float] = None, wait_for_ready: bool = False):
        self._info = await self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(),
                                      timeout, wait_for_ready)
        return self._info

    async def wait_until_ready(self, timeout: float = 30.0):
        """As DecodeClient.wait_until_ready."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            left = deadline - loop.time()
            try:
                return await self.model_info(timeout=max(left, 0.01), wait_for_ready=True)
            except DecodeError as e:
                if not ready_retryable(e):
                    raise
                if loop.time() + 0.05 >= deadline:
                    raise not_ready(self.address, timeout, e) from None
            await asyncio.sleep(0.05)

    async def create_sequence(self, sequence_id: str, *, reserve_tokens: int = 0,
                              timeout: Optional[float] = None) -> int:
        req = pb.CreateSequenceRequest(sequence_id=sequence_id, reserve_tokens=reserve_tokens)
        return (await self._call(self._stub.CreateSequence, req, timeout)).reserved_pages

    async def append_kv(self, sequence_id: str, *, layer: int, start: int, k: ArrayLike,
                        v: ArrayLike, timeout: Optional[float] = None) -> int:
        req = self._append_request(sequence_id, layer, start, k, v)
        return (await self._call(self._stub.AppendKV, req, timeout)).length

    async def fork_sequence(self, sequence_id: str, new_sequence_id: str, *,
                            timeout: Optional[float] = None) -> None:
        req = pb.ForkSequenceRequest(sequence_id=sequence_id, new_sequence_id=new_sequence_id)
        await self._call(self._stub.ForkSequence, req, timeout)

    async def release_sequence(self, sequence_id: str, *, timeout: Optional[float] = None) -> int:
        req = pb.ReleaseSequenceRequest(sequence_id=sequence_id)
        return (await self._call(self._stub.ReleaseSequence, req, timeout)).freed_pages

    def sequence(self, sequence_id: str, *, reserve_tokens: int = 0) -> SequenceScope:
        """`async with client.sequence(id) as seq:` creates it and releases it on exit."""
        return SequenceScope(self, sequence_id, reserve_tokens)

    async def reprefill(self, sequence_id: str, *, kv: KV, reserve_tokens: Optional[int] = None,
                        timeout: Optional[float] = None) -> None:
        """As DecodeClient.reprefill."""
        reserve = self._reserve_for(kv) if reserve_tokens is None else reserve_tokens
        try:
            await self.create_sequence(sequence_id, reserve_tokens=reserve, timeout=timeout)
        except DecodeError as e:
            if e.code != grpc.StatusCode.ALREADY_EXISTS:
                raise
        for req in self._reprefill_requests(sequence_id, kv):
            await self._call(self._stub.AppendKV, req, timeout)

    # -- decode ----------------------------------------------------------------------
    async def decode(self, sequence_id: str, *, layer: int, position: int, q: ArrayLike,
                     k: ArrayLike, v: ArrayLike, gate: ArrayLike, indices: Any,
                     return_lse: bool = False, request_id: int = 0,
                     timeout: Optional[float] = None) -> DecodeResult:
        req = self.make_request(sequence_id, layer=layer, position=position, q=q, k=k, v=v,
                                gate=gate, indices=indices, return_lse=return_lse,
                                request_id=request_id)
        res = parse_response(await self._call(self._stub.Decode, req, timeout))
        first_error([res])
        return res

    async def decode_batch(self, requests: Sequence[Request], *, timeout: Optional[float] = None,
                           raise_on_error: bool = True) -> BatchResults:
        batch, seqs = self._batch_request(requests)
        resp = await self._call(self._stub.DecodeBatch, batch, timeout)
        return batch_results(resp, seqs, raise_on_error)

    async def decode_layer(self, *, layer: int, sequence_ids: Sequence[str],
                           positions: Sequence[int], q: ArrayLike, gate: ArrayLike, k: ArrayLike,
                           v: ArrayLike, indices: Any, topk: Optional[Sequence[int]] = None,
                           out: Any = None, lse: Any = None, return_lse: bool = False,
                           request_id: Optional[int] = None, timeout: Optional[float] = None,
                           raise_on_error: bool = True,
                           on_not_found: Optional[Callable[[str], KV]] = None) -> LayerResult:
        """As DecodeClient.decode_layer (tensors as bytes)."""
        req, ctx = self._layer_request(
            layer=layer, sequence_ids=sequence_ids, positions=positions, q=q, gate=gate, k=k,
            v=v, indices=indices, topk=topk, out=out, lse=lse, return_lse=return_lse,
            request_id=request_id)
        res = self._layer_result(await self._call(self._stub.DecodeLayer, req, timeout), ctx)
        lost = not_found(res.errors)
        if on_not_found is not None and lost:
            for seq in dict.fromkeys(ctx["sequence_ids"][i] for i in lost):
                await self.reprefill(seq, kv=on_not_found(seq), timeout=timeout)
            res = self._layer_result(await self._call(self._stub.DecodeLayer, req, timeout), ctx)
        if raise_on_error:
            first_error(res.errors)
        return res
