"""SequenceScope: a sequence that lives as long as a `with` (or `async with`) block."""
from typing import Optional

import grpc

from .errors import DecodeError


class SequenceScope:
    """Creates the sequence on entry and releases it on exit, also when the block raises.
    A sequence the server no longer has (NOT_FOUND: restarted, expired) counts as released.

        with client.sequence("seq-1", reserve_tokens=2048) as seq:     # DecodeClient
            client.append_kv(seq.id, layer=0, start=0, k=k, v=v)
        async with aclient.sequence("seq-2") as seq: ...              # AsyncDecodeClient
    """

    def __init__(self, client, sequence_id: str, reserve_tokens: int = 0):
        self.client = client
        self.id = sequence_id
        self.reserve_tokens = reserve_tokens
        self.freed_pages: Optional[int] = None  # set on exit

    def __repr__(self) -> str:
        return f"SequenceScope({self.id!r})"

    def __enter__(self) -> "SequenceScope":
        self.client.create_sequence(self.id, reserve_tokens=self.reserve_tokens)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            self.freed_pages = self.client.release_sequence(self.id)
        except DecodeError as e:
            self._release_failed(e, exc)

    async def __aenter__(self) -> "SequenceScope":
        await self.client.create_sequence(self.id, reserve_tokens=self.reserve_tokens)
        return self

    async def __aexit__(self, exc_type, exc, tb) -> None:
        try:
            self.freed_pages = await self.client.release_sequence(self.id)
        except DecodeError as e:
            self._release_failed(e, exc)

    def _release_failed(self, e: DecodeError, exc: Optional[BaseException]) -> None:
        self.freed_pages = 0
        if e.code == grpc.StatusCode.NOT_FOUND or exc is not None:
            return  # gone already; or the block's own error is the one to see
        raise e
