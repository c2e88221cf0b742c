"""Python client for the Sparse Decode Server."""
from .client import DecodeBatchFuture, DecodeClient, DecodeError, DecodeResult
from .layer import LayerResult
from .regions import CudaRegion, SystemRegion
from .stream import DecodeStream, LayerStream
from .tensors import bf16_bits_to_float32, float32_to_bf16_bits

__all__ = ["CudaRegion", "DecodeBatchFuture", "DecodeClient", "DecodeError", "DecodeResult",
           "DecodeStream", "LayerResult", "LayerStream", "SystemRegion",
           "bf16_bits_to_float32", "float32_to_bf16_bits"]
