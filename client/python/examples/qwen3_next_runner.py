#!/usr/bin/env python3
"""Qwen3-Next's gated attention decoded on the Sparse Decode Server.

transformers' own Qwen3NextForCausalLM (a tiny random config, every layer full
attention, fixed seed, no weights downloaded) prefills B prompts; their K/V, taken after
the model's own q_norm/k_norm and RoPE, go to the server through AppendKV. Then every
decode step runs the model three times on the same token:

  ref     the model's own attention in fp32 (transformers' SDPA), dense;
  server  each layer's attention is ONE decode_layer call over the batch [B, ...]
          (q, the pre-sigmoid gate, the new K/V, top-K indices); the server applies
          sigmoid(gate) itself; the same call's inputs also go through the FP8
          emulation below, and the two outputs are compared in bf16 ulps;
  emu     a torch FP8 emulation of the server's maths (DESIGN.md) in every layer,
          from the server run's cache of the step before (the K/V the server holds).

The server's greedy token is fed to all three, so they see the same tokens.

    python qwen3_next_runner.py --print-server-flags        # flags for decode_server
    decode_server --backend=cpu $(python qwen3_next_runner.py --print-server-flags) &
    python qwen3_next_runner.py --server 127.0.0.1:50051 --topk all --check
    python qwen3_next_runner.py --topk oracle --oracle-k 16 --check

--topk all attends to every position; --topk oracle to the K positions with the
highest attention probability per KV head (max over its query heads) in the model's own
fp32 scores. --check exits 1 unless every call is within 1 bf16 ulp of the emulation
and the server's top-1 equals the emulation's at every step for every prompt. Ulps are
taken at max(|value|, the row's max / 64), as tests/reference does, because an output
near zero is a cancellation where any float32 sum is off by more than its own ulp; the
summary also prints the distance without that floor.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import inspect
import math
import sys
import uuid
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from transformers import AttentionInterface, DynamicCache, Qwen3NextConfig, Qwen3NextForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from sparse_decode_client import DecodeClient

ROUTER = "sds_router"  # the attention implementation name this runner registers
FP8_MAX = 448.0
# Our gate split against the model's own `* sigmoid(gate)`: the same float ops, so equal
# (a wrong split is off by O(0.1)); the slack only spares a device's elementwise kernels.
GATE_TOLERANCE = 1e-6
Tensor = torch.Tensor


# -- configuration -----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shape:
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    vocab: int
    prompt_len: int
    steps: int
    batch: int
    scale_mode: str
    k_scale: float
    v_scale: float
    dense_mlp: bool = False

    @property
    def max_positions(self) -> int:
        return self.prompt_len + self.steps


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", default="127.0.0.1:50051", help="decode_server address")
    p.add_argument("--steps", type=int, default=8, help="decode steps")
    p.add_argument("--batch", type=int, default=2, help="prompts decoded together (B)")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="the runner's torch device")
    p.add_argument("--topk", choices=("all", "oracle"), default="all")
    p.add_argument("--oracle-k", type=int, default=16, help="K of --topk oracle (< prompt length)")
    p.add_argument("--check", action="store_true",
                   help="exit 1 unless every call is within 1 bf16 ulp of the FP8 emulation "
                        "and top-1 equals the emulation's at every step")
    p.add_argument("--print-server-flags", action="store_true",
                   help="print the decode_server flags of this config and exit")
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--q-heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, choices=(64, 128), default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dense-mlp", action="store_true",
                   help="dense MLPs instead of MoE: expert routing flips on tiny differences, "
                        "which makes the logits error jump from step to step")
    p.add_argument("--scale-mode", choices=("per_token_head", "per_tensor"), default="per_token_head")
    p.add_argument("--k-scale", type=float, default=1 / 64, help="per_tensor K scale (all layers)")
    p.add_argument("--v-scale", type=float, default=1 / 256, help="per_tensor V scale (all layers)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the server")
    args = p.parse_args(argv)
    if args.topk == "oracle" and not 0 < args.oracle_k < args.prompt_len:
        p.error("--oracle-k must be in [1, --prompt-len) so that K < positions at every step")
    if args.q_heads % args.kv_heads:
        p.error("--q-heads must be a multiple of --kv-heads")
    return args


def shape_of(args: argparse.Namespace) -> Shape:
    return Shape(layers=args.layers, q_heads=args.q_heads, kv_heads=args.kv_heads,
                 head_dim=args.head_dim, hidden=args.hidden, vocab=args.vocab,
                 prompt_len=args.prompt_len, steps=args.steps, batch=args.batch,
                 scale_mode=args.scale_mode, k_scale=args.k_scale, v_scale=args.v_scale,
                 dense_mlp=args.dense_mlp)


def server_flags(s: Shape) -> List[str]:
    """decode_server flags whose shape matches this model (--max_topk covers --topk all,
    which lists every position)."""
    flags = [f"--num_layers={s.layers}", f"--num_q_heads={s.q_heads}",
             f"--num_kv_heads={s.kv_heads}", f"--head_dim={s.head_dim}",
             f"--max_topk={s.max_positions}", f"--max_batch_size={max(64, s.batch)}",
             f"--scale_mode={s.scale_mode}"]
    if s.scale_mode == "per_tensor":
        flags += [f"--k_scales={s.k_scale!r}", f"--v_scales={s.v_scale!r}"]
    return flags


def check_server_shape(info, s: Shape) -> None:
    """Refuses a server whose shape or scale mode differs from the model's: its answers
    would be rejected, or computed with other scales than the emulation's."""
    want = dict(num_layers=s.layers, num_q_heads=s.q_heads, num_kv_heads=s.kv_heads,
                head_dim=s.head_dim, scale_mode=s.scale_mode)
    got = {k: getattr(info, k) for k in want}
    if got != want or info.max_topk < s.max_positions:
        sys.exit(f"server config {got} (max_topk {info.max_topk}) does not match the model's "
                 f"{want} (max_topk >= {s.max_positions}); start it with: "
                 f"{' '.join(server_flags(s))}")


def build_model(s: Shape, seed: int, device: torch.device) -> Qwen3NextForCausalLM:
    """A tiny random Qwen3-Next: all layers full attention, small MoE MLPs (or dense), fp32."""
    torch.manual_seed(seed)
    config = Qwen3NextConfig(
        vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=2 * s.hidden,
        num_hidden_layers=s.layers, num_attention_heads=s.q_heads,
        num_key_value_heads=s.kv_heads, head_dim=s.head_dim,
        layer_types=["full_attention"] * s.layers, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=s.hidden // 2, shared_expert_intermediate_size=s.hidden // 2,
        mlp_only_layers=list(range(s.layers)) if s.dense_mlp else [],
        max_position_embeddings=max(256, s.max_positions))
    config._attn_implementation = ROUTER
    return Qwen3NextForCausalLM(config).to(device=device, dtype=torch.float32).eval()


# -- FP8 emulation of the server's maths (DESIGN.md, "Maths") -------------------------------
def fp8_store(x: Tensor, scale: Tensor) -> Tensor:
    """The stored E4M3 values (as float32) of bf16 x: fp8(x / scale), float32 division,
    round to nearest even, saturating at +-448 (torch's cast alone would give NaN)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def kv_scales(x: Tensor, mode: str, per_tensor: float) -> Tensor:
    """Scale of each (token, KV head) of x [B, Hkv, T, D] as [B, Hkv, T, 1] float32."""
    if mode == "per_tensor":
        return torch.full((*x.shape[:-1], 1), per_tensor, dtype=torch.float32, device=x.device)
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    scale = amax / FP8_MAX
    return torch.where(amax == 0, torch.ones_like(scale), scale)


def gather_positions(x: Tensor, indices: Tensor) -> Tensor:
    """x [B, Hkv, T, C] at indices [B, Hkv, K] -> [B, Hkv, K, C]."""
    return torch.gather(x, 2, indices.long().unsqueeze(-1).expand(-1, -1, -1, x.shape[-1]))


def emulate(q: Tensor, gate: Tensor, k: Tensor, v: Tensor, indices: Tensor, mode: str,
            k_scale: float, v_scale: float) -> Tensor:
    """The server's output for q, gate [B, Hq, D], cached k, v [B, Hkv, T, D] (bf16) and
    indices [B, Hkv, K]: FP8 K/V, softmax in fp32, times sigmoid(gate), rounded to bf16."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    ks, vs = kv_scales(k, mode, k_scale), kv_scales(v, mode, v_scale)
    kq = gather_positions(fp8_store(k, ks), indices)
    vq = gather_positions(fp8_store(v, vs), indices) * gather_positions(vs, indices)
    qg = q.float().view(b, hkv, hq // hkv, d)  # query head h reads KV head h // G
    s = torch.einsum("bkgd,bktd->bkgt", qg, kq) * gather_positions(ks, indices).squeeze(-1)[:, :, None]
    p = torch.softmax(s / math.sqrt(d), dim=-1)
    o = torch.einsum("bkgt,bktd->bkgd", p, vq).reshape(b, hq, d)
    return (o * torch.sigmoid(gate.float())).to(torch.bfloat16)


def bf16_ulp(x: Tensor) -> Tensor:
    """bf16 spacing at magnitude |x| (float32; normal range, subnormals clamp)."""
    _, e = torch.frexp(x.abs().clamp(min=2.0 ** -126))
    return torch.ldexp(torch.ones_like(x), e - 8)


def ulps(got: Tensor, want: Tensor) -> float:
    """Max |got - want| over [B, Hq, D] in bf16 ulps taken at max(|want|, row max / 64),
    as tests/reference does: an element near zero is a cancellation, where any float32
    sum (the server's, the emulation's) is off by more than its own bf16 ulp."""
    a, b = got.float().cpu(), want.float().cpu()
    floor = b.abs().amax(dim=-1, keepdim=True) / 64
    return float(((a - b).abs() / bf16_ulp(torch.maximum(b.abs(), floor))).max())


def ordered_bf16(x: Tensor) -> Tensor:
    """bf16 bits as integers whose difference counts representable values between them."""
    bits = x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.where(bits >= 0x8000, 0x8000 - bits, bits)


def bit_distance(got: Tensor, want: Tensor) -> int:
    """Max count of bf16 values between got and want, with no floor (for the record)."""
    return int((ordered_bf16(got.cpu()) - ordered_bf16(want.cpu())).abs().max())


# -- top-K selection ----------------------------------------------------------------------
def all_positions(b: int, hkv: int, t: int, device: torch.device) -> Tensor:
    return torch.arange(t, dtype=torch.int32, device=device).expand(b, hkv, t).contiguous()


def oracle_topk(q: Tensor, k: Tensor, scaling: float, top: int) -> Tensor:
    """Per KV head, the `top` positions with the highest attention probability (max over
    the head's query heads) in the model's own fp32 scores; [B, Hkv, K] int32, sorted."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    s = torch.einsum("bkgd,bktd->bkgt", q.float().view(b, hkv, hq // hkv, d), k.float()) * scaling
    best = torch.softmax(s, dim=-1).amax(dim=2)
    return best.topk(top, dim=-1).indices.sort(dim=-1).values.to(torch.int32)


# -- the attention router -------------------------------------------------------------------
@dataclasses.dataclass
class CallRecord:
    layer: int
    max_ulps: float     # against the emulation, at the row scale (see ulps)
    bits: int           # the same without the floor (bit_distance)
    batch_size: int


class Router:
    """The attention implementation of every layer (registered as ROUTER): the model's own
    SDPA in mode "ref", the server or the emulation in modes "server" and "emu".

    The server applies sigmoid(gate) itself, so in those modes the attention's gated
    output replaces o_proj's input (a pre-hook), and the model's own `* sigmoid(gate)`
    acts on a placeholder. The pre-sigmoid gate comes from q_proj's output (a hook),
    split as Qwen3NextAttention splits it: per head, the second half of 2*D values.
    """

    def __init__(self, model: Qwen3NextForCausalLM, s: Shape, pick: Callable[[Tensor, Tensor, float], Tensor]):
        self.s = s
        self.pick = pick
        self.mode = "ref"
        self.client: Optional[DecodeClient] = None
        self.sequence_ids: List[str] = []
        self.scales: Tuple[Sequence[float], Sequence[float]] = ([1.0] * s.layers, [1.0] * s.layers)
        self.capture = False  # keep the K/V of the next forward (the prefill)
        self.prefill_kv: Dict[int, Tuple[Tensor, Tensor]] = {}
        self.calls: List[CallRecord] = []
        self.gate_mismatch = 0.0
        self._q_proj_out: Dict[int, Tensor] = {}
        self._gated: Dict[int, Tensor] = {}
        self._ref_out: Dict[int, Tensor] = {}
        for layer in model.model.layers:
            self._hook(layer.self_attn)

    def _hook(self, attn: torch.nn.Module) -> None:
        idx = attn.layer_idx

        def keep_q_proj(_mod, _inp, out: Tensor) -> None:
            self._q_proj_out[idx] = out

        def replace_o_proj_input(_mod, inp: Tuple[Tensor, ...]):
            if self.mode == "ref":
                self._check_gate(idx, inp[0])
                return None
            gated = self._gated.pop(idx)
            return (gated.to(inp[0].dtype).reshape(inp[0].shape),)

        attn.sds_router = self
        attn.q_proj.register_forward_hook(keep_q_proj)
        attn.o_proj.register_forward_pre_hook(replace_o_proj_input)

    def gate(self, layer: int) -> Tensor:
        """The pre-sigmoid gate [B, Hq, D] of the layer's single new token."""
        out = self._q_proj_out[layer]
        b = out.shape[0]
        return out[:, -1].view(b, self.s.q_heads, 2 * self.s.head_dim)[..., self.s.head_dim:]

    def _check_gate(self, layer: int, o_proj_in: Tensor) -> None:
        """In ref mode, o_proj's input must be attention * sigmoid(our gate) exactly:
        proof that the gate split above is the model's."""
        ref = self._ref_out.pop(layer, None)
        if ref is None or o_proj_in.shape[1] != 1:
            return
        full = self._q_proj_out[layer]
        b, t = full.shape[:2]
        gate_all = full.view(b, t, self.s.q_heads, 2 * self.s.head_dim)[..., self.s.head_dim:]
        mine = ref.reshape(b, t, -1) * torch.sigmoid(gate_all.reshape(b, t, -1))
        self.gate_mismatch = max(self.gate_mismatch, float((mine - o_proj_in).abs().max()))

    def __call__(self, module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                 attention_mask: Optional[Tensor], scaling: float, dropout: float = 0.0,
                 **kwargs) -> Tuple[Tensor, None]:
        layer = module.layer_idx
        if self.mode == "ref":
            if self.capture:  # the K/V the cache holds: after k_norm and RoPE
                self.prefill_kv[layer] = (key.detach().clone(), value.detach().clone())
            out, _ = sdpa_attention_forward(module, query, key, value, attention_mask,
                                            dropout=dropout, scaling=scaling, **kwargs)
            self._ref_out[layer] = out
            return out, None
        if query.shape[2] != 1:
            raise RuntimeError("server and emu modes run single-token decode steps only")
        q = query[:, :, 0].to(torch.bfloat16)
        g = self.gate(layer).to(torch.bfloat16)
        kb, vb = key.to(torch.bfloat16), value.to(torch.bfloat16)
        indices = self.pick(query[:, :, 0], key, scaling)
        # The emulation runs on the CPU whatever the model's device: on the H200 the same
        # emulation on CUDA torch was up to ~100 bf16 ulps off both servers (CPU and CUDA
        # backends alike), while on the CPU it agreed with the CUDA server to 1 ulp.
        emu = emulate(q.cpu(), g.cpu(), kb.cpu(), vb.cpu(), indices.cpu(), self.s.scale_mode,
                      self.scales[0][layer], self.scales[1][layer]).to(q.device)
        gated = emu if self.mode == "emu" else self._server_call(layer, q, g, kb, vb, indices, emu)
        self._gated[layer] = gated
        b, hq, d = q.shape
        return torch.zeros(b, 1, hq, d, dtype=query.dtype, device=query.device), None

    def _server_call(self, layer: int, q: Tensor, gate: Tensor, k: Tensor, v: Tensor,
                     indices: Tensor, emu: Tensor) -> Tensor:
        """One decode_layer call for the whole batch; the new token's K/V is the cache's
        last position, written by the call itself. Tensors travel as bytes from CPU copies
        (a CUDA tensor goes by reference only from a registered CUDA region, which needs
        the server's --allow_client_shm)."""
        pos = k.shape[2] - 1
        res = self.client.decode_layer(
            layer=layer, sequence_ids=self.sequence_ids, positions=[pos] * q.shape[0],
            q=q.cpu(), gate=gate.cpu(), k=k[:, :, pos].cpu(), v=v[:, :, pos].cpu(),
            indices=indices.cpu())
        out = res.out.to(q.device)
        self.calls.append(CallRecord(layer, ulps(out, emu), bit_distance(out, emu),
                                     res.batch.get("batch_size", 0)))
        return out


def routed_attention(module: torch.nn.Module, *args, **kwargs) -> Tuple[Tensor, None]:
    """The function registered as ROUTER (transformers checks the name when the model is
    built, before any Router exists): hands over to the module's Router."""
    return module.sds_router(module, *args, **kwargs)


AttentionInterface.register(ROUTER, routed_attention)


# -- running the model ----------------------------------------------------------------------
def cache_kwarg(model: Qwen3NextForCausalLM) -> str:
    """transformers 5.x renamed forward's past_key_values to cache (the old name stays
    accepted for a while): pass whichever this version declares."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward(model: Qwen3NextForCausalLM, router: Router, mode: str, tokens: Tensor,
            cache: DynamicCache) -> Tensor:
    """Last-position logits [B, V] (fp32) of one forward in `mode`; updates `cache`."""
    router.mode = mode
    with torch.no_grad():
        out = model(input_ids=tokens, use_cache=True, **{cache_kwarg(model): cache})
    return out.logits[:, -1].float()


def two_tokens(model: Qwen3NextForCausalLM, router: Router, mode: str, prompts: Tensor,
               token: Tensor) -> Tuple[Tensor, Tensor]:
    """Prefill and one decode step on a fresh cache; both steps' logits."""
    cache = DynamicCache(config=model.config)
    return forward(model, router, mode, prompts, cache), forward(model, router, mode, token, cache)


def stock_difference(model: Qwen3NextForCausalLM, router: Router, prompts: Tensor,
                     token: Tensor) -> float:
    """Max |logits| difference, prefill and one decode step, between mode "ref" and the
    model's stock eager attention (its own mask and code path): "ref" must be the model."""
    ours = two_tokens(model, router, "ref", prompts, token)
    model.set_attn_implementation("eager")
    try:
        stock = two_tokens(model, router, "ref", prompts, token)
    finally:
        model.set_attn_implementation(ROUTER)
    return max(float((a - b).abs().max()) for a, b in zip(ours, stock))


def prefill_model(model: Qwen3NextForCausalLM, router: Router,
                  prompts: Tensor) -> Tuple[DynamicCache, Tensor]:
    """The prompts through the model in mode "ref", keeping their K/V; returns the cache
    and the first decode token (the greedy pick, [B, 1])."""
    cache = DynamicCache(config=model.config)
    router.capture = True
    try:
        logits = forward(model, router, "ref", prompts, cache)
    finally:
        router.capture = False
    stock = stock_difference(model, router, prompts, logits.argmax(dim=-1)[:, None])
    kmax = max(float(k.abs().max()) for k, _ in router.prefill_kv.values())
    vmax = max(float(v.abs().max()) for _, v in router.prefill_kv.values())
    print(f"prefill: max |logits| {float(logits.abs().max()):.3g}, max |K| {kmax:.3g}, "
          f"max |V| {vmax:.3g}; mode ref vs the model's stock eager attention: max |logits| "
          f"difference {stock:.3g}")
    return cache, logits.argmax(dim=-1)[:, None]


def append_prefill(client: DecodeClient, router: Router, sequence_ids: List[str]) -> None:
    """AppendKV of every layer's prompt K/V, [T, Hkv, D] per sequence, in bf16."""
    for layer, (k, v) in sorted(router.prefill_kv.items()):
        for b, seq in enumerate(sequence_ids):
            client.append_kv(seq, layer=layer, start=0,
                             k=k[b].transpose(0, 1).to(torch.bfloat16).cpu(),
                             v=v[b].transpose(0, 1).to(torch.bfloat16).cpu())


@dataclasses.dataclass
class StepReport:
    step: int
    position: int
    err_server: float   # max |logits_server - logits_ref|
    err_emu: float      # max |logits_emu - logits_ref|
    err_server_emu: float
    max_ulps: float     # worst call of the step against the emulation
    ulps_per_layer: List[float]
    top1_server_emu: int
    top1_server_ref: int
    batch: int
    emu_margin: float   # smallest top-1 minus top-2 logit of the emulation over the batch

    def line(self) -> str:
        return (f"step {self.step:3d} pos {self.position:4d}: logits max|server-ref| "
                f"{self.err_server:.3e} max|emu-ref| {self.err_emu:.3e} max|server-emu| "
                f"{self.err_server_emu:.3e}; calls vs emu max ulps "
                f"[{', '.join(f'{u:.2f}' for u in self.ulps_per_layer)}]; "
                f"top-1 server=emu {self.top1_server_emu}/{self.batch} "
                f"server=ref {self.top1_server_ref}/{self.batch} (emu top-1 margin "
                f"{self.emu_margin:.2e})")

    @property
    def ok(self) -> bool:
        return self.max_ulps <= 1 and self.top1_server_emu == self.batch


def decode_step(model: Qwen3NextForCausalLM, router: Router, caches: Dict[str, DynamicCache],
                token: Tensor, step: int, position: int) -> Tuple[StepReport, Tensor]:
    """One token through all three modes; returns the report and the server's greedy token."""
    first_call = len(router.calls)
    # The emulation starts each step from the server run's cache, so that the K/V of
    # earlier steps are the ones the server holds: a 1-ulp difference of an earlier call
    # must not grow into a different top-1 of this one.
    emu_cache = copy.deepcopy(caches["server"])
    logits = {"ref": forward(model, router, "ref", token, caches["ref"]),
              "emu": forward(model, router, "emu", token, emu_cache),
              "server": forward(model, router, "server", token, caches["server"])}
    step_calls = router.calls[first_call:]
    top = {mode: lg.argmax(dim=-1) for mode, lg in logits.items()}
    report = StepReport(
        step=step, position=position,
        err_server=float((logits["server"] - logits["ref"]).abs().max()),
        err_emu=float((logits["emu"] - logits["ref"]).abs().max()),
        err_server_emu=float((logits["server"] - logits["emu"]).abs().max()),
        max_ulps=max(c.max_ulps for c in step_calls),
        ulps_per_layer=[c.max_ulps for c in step_calls],
        top1_server_emu=int((top["server"] == top["emu"]).sum()),
        top1_server_ref=int((top["server"] == top["ref"]).sum()),
        batch=token.shape[0],
        emu_margin=float(logits["emu"].topk(2, dim=-1).values.diff(dim=-1).abs().min()))
    return report, top["server"][:, None]


def picker(args: argparse.Namespace) -> Callable[[Tensor, Tensor, float], Tensor]:
    if args.topk == "all":
        return lambda q, k, _scaling: all_positions(k.shape[0], k.shape[1], k.shape[2], k.device)
    return lambda q, k, scaling: oracle_topk(q, k, scaling, args.oracle_k)


def run(args: argparse.Namespace, s: Shape, client: DecodeClient) -> bool:
    device = torch.device(args.device)
    torch.set_float32_matmul_precision("highest")  # no TF32: fp32 for ref and emulation
    model = build_model(s, args.seed, device)
    router = Router(model, s, picker(args))
    info = client.model_info()
    if s.scale_mode == "per_tensor":
        router.scales = (list(info.k_scales), list(info.v_scales))
    gen = torch.Generator().manual_seed(args.seed + 1)
    prompts = torch.randint(0, s.vocab, (s.batch, s.prompt_len), generator=gen).to(device)
    cache, first_token = prefill_model(model, router, prompts)
    caches = {mode: copy.deepcopy(cache) for mode in ("ref", "server")}
    run_id = uuid.uuid4().hex[:8]
    router.sequence_ids = [f"qwen3next-{run_id}-{b}" for b in range(s.batch)]
    with contextlib.ExitStack() as stack:
        for seq in router.sequence_ids:
            stack.enter_context(client.sequence(seq, reserve_tokens=s.max_positions))
        router.client = client
        append_prefill(client, router, router.sequence_ids)
        print(f"appended {s.batch} x {s.prompt_len} tokens x {s.layers} layers (AppendKV)")
        return decode_loop(model, router, caches, first_token, s)


def decode_loop(model: Qwen3NextForCausalLM, router: Router, caches: Dict[str, DynamicCache],
                token: Tensor, s: Shape) -> bool:
    """Steps 0..steps-1 from `token` (the prefill's greedy pick, [B, 1])."""
    ok = True
    for step in range(s.steps):
        report, token = decode_step(model, router, caches, token, step, s.prompt_len + step)
        print(report.line(), flush=True)
        ok &= report.ok
    calls = router.calls
    sizes = sorted({c.batch_size for c in calls})
    print(f"{len(calls)} decode_layer calls of {s.batch} items (server batch sizes {sizes}): "
          f"max ulps vs FP8 emulation {max(c.max_ulps for c in calls):.2f} (bf16 values "
          f"apart, no floor: {max(c.bits for c in calls)}); gate split check "
          f"(ref) max diff {router.gate_mismatch:.3g}")
    return ok and router.gate_mismatch <= GATE_TOLERANCE


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    s = shape_of(args)
    if args.print_server_flags:
        print(" ".join(server_flags(s)))
        return 0
    with DecodeClient(args.server) as client:
        info = client.wait_until_ready(timeout=args.timeout)
        check_server_shape(info, s)
        print(f"server {args.server}: backend {info.backend}, scale_mode {info.scale_mode}; "
              f"model {s.layers} layers, {s.q_heads}/{s.kv_heads} heads, D {s.head_dim}, "
              f"B {s.batch}, prompt {s.prompt_len}, topk "
              f"{args.topk if args.topk == 'all' else f'oracle K={args.oracle_k}'}, "
              f"device {args.device}")
        ok = run(args, s, client)
    if args.check and not ok:
        print("CHECK FAILED: a call beyond 1 bf16 ulp of the FP8 emulation, or a top-1 "
              "different from the emulation's", file=sys.stderr)
        return 1
    print("check passed" if args.check else "done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
