"""Python client for the Sparse Decode Server."""
from .client import DecodeBatchFuture, DecodeClient, DecodeError, DecodeResult
from .stream import DecodeStream
from .tensors import bf16_bits_to_float32, float32_to_bf16_bits

__all__ = ["DecodeBatchFuture", "DecodeClient", "DecodeError", "DecodeResult", "DecodeStream",
           "bf16_bits_to_float32", "float32_to_bf16_bits"]
