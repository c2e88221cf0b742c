"""Python client for the Sparse Decode Server."""
from .aio import AsyncDecodeClient
from .client import DecodeBatchFuture, DecodeClient
from .errors import DecodeError
from .layer import LayerResult
from .regions import CudaRegion, SystemRegion
from .results import DecodeResult
from .sequence import SequenceScope
from .stream import DecodeStream, LayerStream
from .tensors import bf16_bits, bf16_bits_to_float32, float32_to_bf16_bits

__all__ = ["AsyncDecodeClient", "CudaRegion", "DecodeBatchFuture", "DecodeClient", "DecodeError",
           "DecodeResult", "DecodeStream", "LayerResult", "LayerStream", "SequenceScope",
           "SystemRegion", "bf16_bits", "bf16_bits_to_float32", "float32_to_bf16_bits"]
