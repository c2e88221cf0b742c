"""What the decode RPCs answer, as the client returns it."""
import dataclasses
from typing import List, Optional, Sequence, Union

import grpc
import numpy as np

from .errors import DecodeError, first_error
from .tensors import BF16, bf16_bits_to_float32, read_tensor


@dataclasses.dataclass
class DecodeResult:
    request_id: int
    out_bits: np.ndarray            # [Hq, D] uint16, the raw bf16 bits
    lse: Optional[np.ndarray]       # [Hq] float32, natural log; None unless asked for
    batch: dict                     # batch_id, batch_size, queue_us, compute_us

    @property
    def out(self) -> np.ndarray:
        """[Hq, D] float32 (exactly the bf16 values)."""
        return bf16_bits_to_float32(self.out_bits)

    @property
    def out_bf16(self) -> np.ndarray:
        """[Hq, D] ml_dtypes.bfloat16, a view of out_bits."""
        return self.out_bits.view(BF16)

    def out_torch(self):
        """[Hq, D] torch.bfloat16 (CPU), a copy (out_bits is a read-only view of the
        answer); needs torch."""
        import torch
        return torch.from_numpy(self.out_bits.view(np.int16).copy()).view(torch.bfloat16)


def batch_info(b) -> dict:
    return dict(batch_id=b.batch_id, batch_size=b.batch_size, queue_us=b.queue_us,
                compute_us=b.compute_us)


def parse_response(resp, index: Optional[int] = None,
                   sequence_id: Optional[str] = None) -> Union[DecodeResult, DecodeError]:
    if resp.error_code != 0:
        return DecodeError.from_int(resp.error_code, resp.error_message, index=index,
                                    sequence_id=sequence_id)
    out = read_tensor(resp.out)
    lse = read_tensor(resp.lse) if resp.HasField("lse") and resp.lse.data else None
    return DecodeResult(resp.request_id, out, lse, batch_info(resp.batch))


def batch_results(resp, sequence_ids: Sequence[str],
                  raise_on_error: bool) -> List[Union[DecodeResult, DecodeError]]:
    """A DecodeBatchResponse as decode_batch returns it (one entry per request)."""
    # Results are matched to requests by position: a short or long answer would pair
    # outputs with the wrong requests, or drop some silently.
    if len(resp.responses) != len(sequence_ids):
        raise DecodeError(grpc.StatusCode.INTERNAL,
                          f"DecodeBatch answered {len(resp.responses)} responses to "
                          f"{len(sequence_ids)} requests")
    results = [parse_response(r, i, s) for i, (r, s) in enumerate(zip(resp.responses, sequence_ids))]
    if raise_on_error:
        first_error(results)
    return results


def not_found(errors) -> List[int]:
    """Indices of the items that failed NOT_FOUND (a sequence the server does not have)."""
    return [i for i, e in enumerate(errors)
            if isinstance(e, DecodeError) and e.code == grpc.StatusCode.NOT_FOUND]
