"""DecodeError: a failed call, or one failed item of a batched call."""
from typing import Optional

import grpc

_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


class DecodeError(Exception):
    """`code` is a grpc.StatusCode and `message` says why; `index` and `sequence_id` name
    the item of a batched call that failed (None for a whole call)."""

    def __init__(self, code: grpc.StatusCode, message: str, *, index: Optional[int] = None,
                 sequence_id: Optional[str] = None):
        where = ""
        if index is not None:
            where = f"item {index}" + (f" ({sequence_id})" if sequence_id else "") + ": "
        super().__init__(f"{where}{code.name}: {message}")
        self.code = code
        self.message = message
        self.index = index
        self.sequence_id = sequence_id

    @classmethod
    def from_rpc(cls, e: grpc.RpcError) -> "DecodeError":
        return cls(e.code(), e.details() or "")

    @classmethod
    def from_int(cls, code: int, message: str, **item) -> "DecodeError":
        return cls(_BY_VALUE.get(int(code), grpc.StatusCode.UNKNOWN), message, **item)


def first_error(errors):
    """Raises the first DecodeError of a per-item list, if any."""
    for e in errors:
        if isinstance(e, DecodeError):
            raise e
