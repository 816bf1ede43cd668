"""FusedLayerOps: forerun.models.ops.LayerOps on CUDA with the kernels of forerun/kernels (Triton, CUDA C++).

(It lives with the models, not the kernels, so that kernels import nothing above them: the kernels are functions
on tensors, this class wires them into a model's layers.)

Per decoder layer this makes 8 launches plus attention (add+RMSNorm, qkv product, Q/K norm + RoPE + cache
write, attention, o_proj, add+RMSNorm, gate/up product with SwiGLU, down product) where the torch path makes
~40. Matrix products with at most `max_skinny_rows` rows (decode, verification of short chains at small
batches) use the skinny Triton kernel; larger ones stay with cuBLAS. Tensors on other devices fall back to
torch (`devices` adds "cpu" for tests under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from ..attention import fused_decode
from ..devices import card_switch
from ..kernels.fused_norm import add_rmsnorm, qk_norm_rope_store
from ..kernels.skinny_gemm import MAX_ROWS, GemmConfig, config_key, default_config, load_configs, skinny_linear
from .ops import LayerOps
from .vocab_subset import SubsetHead


class FusedLayerOps(LayerOps):
    PDL_NORM_ROWS = 8  # pdl_norms applies to steps of up to this many tokens
    # split_norms on by default: a card whose step measured faster with it (q4_step_budget.py) and whose GPU tests
    # pass with FORERUN_SPLIT_NORMS=1. The H100: faster (session 50), and tests/test_gpu.py, test_q4_gpu_kernels.py
    # and test_gguf_cuda.py pass with it on (session 51, benchmarks/results/gpu_tests_session51_split_h100.txt).
    # Not the H200: slower there.
    SPLIT_NORMS_CARDS: tuple[str, ...] = ("NVIDIA H100 80GB HBM3",)

    def __init__(self, max_skinny_rows: int = MAX_ROWS, devices: tuple[str, ...] = ("cuda",),
                 device_name: str | None = None, pdl_norms: bool | None = None, fuse_norms: bool | None = None,
                 split_norms: bool | None = None) -> None:
        """pdl_norms: add + RMSNorm launched with PDL (True for models whose products are int4 kernels, which fetch
        weights before waiting; None: kernels/fused_norm.py's default). fuse_norms: 1-row add + RMSNorm done in the
        prologue of the product after it where that product can (quantized matrices with `norm_product`: the
        CUDA C++ int4 kernel); None: off unless FORERUN_FUSE_NORMS=1. Off because it measured slower on the H200
        (8B-shape int4 step 1.998 -> 2.076 ms, docs/performance.md; on the H100, session 49, with the row kept in
        registers: 2.143 -> 2.203 ms, docs/quantization.md): the norm's own kernel runs while the product after it
        fetches its weights, whereas in the prologue every block repeats it after its wait.
        split_norms: in 1-row steps, each add + RMSNorm between two int4 products on the CUDA C++ kernel is split
        between them: the product before (o, down) adds the residual in its epilogue and leaves one sum of squares
        per block, the product after (gate/up, the next qkv, the head) adds those up and normalises its row as
        it converts it (`linear_add`; kernels/q4_cuda.q4c_add_linear / q4c_split_norm_linear), and no norm kernel
        runs between them. None: FORERUN_SPLIT_NORMS=1 / 0 if set, else on for the cards in SPLIT_NORMS_CARDS
        (the H100). Measured (session 50, docs/quantization.md): the 8B-shape int4 step on the H100 2.122-2.126 ->
        2.089-2.096 ms, on the H200 1.790 -> 1.812 ms (its products wait longer for the partial sums than its norm
        kernels took)."""
        self.max_skinny_rows = min(max_skinny_rows, MAX_ROWS)
        self.pdl_norms = pdl_norms
        self.fuse_norms = os.environ.get("FORERUN_FUSE_NORMS", "0") == "1" if fuse_norms is None else fuse_norms
        if device_name is None and torch.cuda.is_available():
            device_name = torch.cuda.get_device_name()
        if split_norms is None:
            env = card_switch("FORERUN_SPLIT_NORMS")
            split_norms = env if env is not None else device_name in self.SPLIT_NORMS_CARDS
        self.split_norms = split_norms
        card_switch("FORERUN_Q4_DP4A")  # (kernels/q4_cuda.int8_activations) refused here, at load, if misspelt
        self._sums: tuple[torch.Tensor, torch.Tensor] | None = None  # (s, its partial sums of squares): linear_add
        self.devices = devices
        # tuned configurations for this card: a config, or None where cuBLAS measured faster
        self.configs = load_configs(device_name) if device_name else {}

    def _config(self, x: torch.Tensor, layer: nn.Module, glu: bool = False) -> GemmConfig | None:
        """The skinny kernel's configuration for this product, or None to leave it to torch / cuBLAS."""
        if not self._skinny(x, layer):
            return None
        m, (n, k) = x.shape[0], layer.weight.shape
        n = n // 2 if glu else n
        key = config_key(m, n, k, glu)
        if key in self.configs and x.element_size() == 2:  # the table was tuned with bf16
            return self.configs[key]
        return default_config(m, n, k, x.element_size())

    def _on(self, x: torch.Tensor) -> bool:
        return x.device.type in self.devices

    def _skinny(self, x: torch.Tensor, layer: nn.Module) -> bool:
        return (self._on(x) and 1 <= x.shape[0] <= self.max_skinny_rows and isinstance(layer, nn.Linear)
                and x.dtype == layer.weight.dtype and x.stride(-1) == 1)

    def add_rmsnorm(self, x, residual, norm):
        if not self._on(x):
            return super().add_rmsnorm(x, residual, norm)
        # (not past 8 rows: before the 16-row tensor-core products of int4 models it measured 13 % slower)
        pdl = self.pdl_norms if x.shape[0] <= self.PDL_NORM_ROWS else False
        return add_rmsnorm(x, residual, norm.weight, norm.eps, pdl=pdl)

    def linear(self, x, layer, out_dtype=None):
        if isinstance(layer, SubsetHead):  # a draft's head over part of the vocabulary: its rows through the kernels
            return layer.scatter(self.linear(x, layer.head, out_dtype))
        cfg = self._config(x, layer)
        if cfg is None:
            return super().linear(x, layer, out_dtype)
        return skinny_linear(x, layer.weight, layer.bias, out_dtype=out_dtype, config=cfg)

    def mlp(self, x, mlp):
        if not self._on(x):
            return super().mlp(x, mlp)
        gate_up = mlp.gate_up_proj
        if hasattr(gate_up, "glu"):  # a quantized matrix (models/quant_cuda.py): its kernel fuses the SwiGLU
            return self.linear(gate_up.glu(x), mlp.down_proj)
        cfg = self._config(x, gate_up, glu=True) if gate_up.bias is None else None
        if cfg is not None:
            act = skinny_linear(x, gate_up.weight, glu=True, config=cfg)  # SwiGLU in the product's epilogue
        else:
            act = mlp.activation(gate_up(x))
        return self.linear(act, mlp.down_proj)

    def _norm_product(self, x, residual, norm, layer, glu: bool):
        """(product of norm(x + residual), x + residual) from one launch, or None where that cannot run."""
        if not (self.fuse_norms and self._on(x) and x.shape[0] == 1 and hasattr(layer, "norm_product")):
            return None
        return layer.norm_product(x, residual, norm.weight, norm.eps, glu)

    def _partials(self, x, residual):
        """The partial sums of squares of x where x is the stream the last `linear_add` wrote, else None."""
        got = self._sums
        return got[1] if residual is None and got is not None and got[0] is x else None

    def linear_add(self, x, layer, residual):
        if self.split_norms and residual is not None and self._on(x) and hasattr(layer, "add_product"):
            got = layer.add_product(x, residual)
            if got is not None:
                self._sums = got
                return got[0], None
        return super().linear_add(x, layer, residual)

    def norm_linear(self, x, residual, norm, layer, out_dtype=None):
        parts = self._partials(x, residual)
        if parts is not None and hasattr(layer, "split_norm_product"):
            y = layer.split_norm_product(x, parts, norm.weight, norm.eps)
            if y is not None:
                return (y if out_dtype is None else y.to(out_dtype)), x
        got = self._norm_product(x, residual, norm, layer, False)
        if got is None:
            return super().norm_linear(x, residual, norm, layer, out_dtype)
        y, s = got
        return (y if out_dtype is None else y.to(out_dtype)), s

    def norm_mlp(self, x, residual, norm, mlp):
        gate_up = mlp.gate_up_proj
        parts = self._partials(x, residual)
        if parts is not None and hasattr(gate_up, "split_norm_product"):
            act = gate_up.split_norm_product(x, parts, norm.weight, norm.eps, glu=True)
            if act is not None:  # SwiGLU in the product's epilogue; down adds x in its own where it can
                return self.linear_add(act, mlp.down_proj, x)
        if self.split_norms and not self.fuse_norms and self._on(x) and x.shape[0] == 1 \
                and hasattr(mlp.down_proj, "add_product") and hasattr(gate_up, "glu"):
            # the norm apart (x came without partial sums), the add after down in its epilogue
            h, s = self.add_rmsnorm(x, residual, norm)
            return self.linear_add(gate_up.glu(h), mlp.down_proj, s)
        got = self._norm_product(x, residual, norm, mlp.gate_up_proj, True)
        if got is None:
            return super().norm_mlp(x, residual, norm, mlp)
        act, s = got  # SwiGLU in the product's epilogue
        return self.linear(act, mlp.down_proj), s

    def decode_attention(self, qkv, positions, rope, q_norm, k_norm, layer, meta, kv, num_heads, num_kv_heads,
                         head_dim, backend, scale, window):
        # decode steps on a backend that lets its decode attention be fused with the RoPE before it: Q/K norm,
        # RoPE, the cache write, the split attention and its merge in one launch (attention/fused_decode.py)
        qw, kw = (q_norm.weight, k_norm.weight) if q_norm is not None else (None, None)
        if not (self._on(qkv) and getattr(backend, "fuses_decode", False) and fused_decode.supports(
                qkv, positions, rope.cos, rope.sin, qw, kw, meta, kv.k[layer], kv.v[layer], num_heads, num_kv_heads,
                head_dim, window)):
            return None
        return fused_decode.attention(qkv, positions, rope.cos, rope.sin, qw, kw, q_norm.eps if q_norm is not None
                                      else 0.0, meta, kv.k[layer], kv.v[layer], num_heads, num_kv_heads, head_dim,
                                      scale)

    def qkv_to_cache(self, qkv, positions, rope, q_norm, k_norm, layer, meta, kv, num_heads, num_kv_heads, head_dim):
        if not self._on(qkv) or head_dim & (head_dim - 1):
            return super().qkv_to_cache(qkv, positions, rope, q_norm, k_norm, layer, meta, kv,
                                        num_heads, num_kv_heads, head_dim)
        eps = q_norm.eps if q_norm is not None else 0.0
        return qk_norm_rope_store(
            qkv, positions, rope.cos, rope.sin, q_norm.weight if q_norm is not None else None,
            k_norm.weight if k_norm is not None else None, eps, meta.slot_mapping, kv.k[layer], kv.v[layer],
            num_heads, num_kv_heads, head_dim)
