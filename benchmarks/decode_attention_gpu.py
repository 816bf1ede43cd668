"""Decode attention between int4 products (#12): what one layer's attention costs inside a chain shaped like the 8B
decode step, for the Triton split + merge kernels and variants of the one-launch CUDA kernel (attention/
cuda_decode.py: warps per block, KV splits, where a block lets the next kernel launch, PDL on or off).

Per layer the chain runs the qkv product (int4, 4096 -> 6144, the CUDA C++ kernel), attention over that layer's own
paged cache (Qwen3-8B: 32 query heads, 8 KV heads, D 128, pages of 16) and the o-projection (int4, 4096 -> 4096), 36
layers in one CUDA graph; "no attention" feeds q straight to the o-projection. A variant's attention cost per layer
is (its chain - the chain without attention) / 36: launch boundaries and the overlap with the products included,
which is what the decode step pays. Variants run interleaved, best of the repeats. Prints a table, writes JSON
(+ PNG).

    python benchmarks/decode_attention_gpu.py --out benchmarks/results/decode_attention_h200.json
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu as G  # noqa: E402
from forerun.attention import cuda_decode  # noqa: E402
from forerun.attention.metadata import AttnMetadata  # noqa: E402
from forerun.attention.triton_backend import TritonPagedAttention  # noqa: E402
from forerun.kernels import nvrtc  # noqa: E402
from forerun.kernels.q4_cuda import q4c_linear  # noqa: E402

LAYERS, HQ, HKV, D, PAGE, HIDDEN = 36, 32, 8, 128, 16, 4096
QKV = dict(rows=2, warps=16, depth=2)  # the H200's tuned configurations (kernels/q4_configs.json)
O_PROJ = dict(rows=1, warps=16, depth=6)

# name -> attention call (q, k, v, meta) -> out; None: no attention
def _cuda(**kw):
    return lambda q, k, v, meta: cuda_decode.decode_attention(q, k, v, meta, D ** -0.5, **kw)


_COPY = r"""
extern "C" __global__ void pdl_copy(const unsigned int* __restrict__ q, unsigned int* __restrict__ out, int n) {
    asm volatile("griddepcontrol.launch_dependents;");
    asm volatile("griddepcontrol.wait;" ::: "memory");
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = q[i];
}
"""


def copy_q(q, k, v, meta):
    """The least a kernel between the products can cost: PDL launch, wait, copy q (8 blocks; batch 1)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    nvrtc.launch(nvrtc.kernel(_COPY, "pdl_copy"), 8, 256, 0, [q, out, q.shape[1] * q.shape[2] // 2], True)
    return out


VARIANTS = {
    "no attention": None,
    "a PDL kernel copying q (floor of any kernel here)": copy_q,
    "Triton split + merge": lambda q, k, v, meta: TritonPagedAttention().forward(q, k, v, meta, D ** -0.5),
    "CUDA 4 warps, auto splits": _cuda(warps=4, trigger=0),
    "CUDA 4 warps, auto splits, trigger at exit": _cuda(warps=4, trigger=2),
    "CUDA 4 warps, auto splits, no PDL": _cuda(warps=4, pdl=False),
    "CUDA 4 warps, 4 splits": _cuda(warps=4, trigger=0, num_splits=4),
    "CUDA 8 warps, auto splits": _cuda(warps=8, trigger=0),
    "CUDA 8 warps, 8 splits": _cuda(warps=8, trigger=0, num_splits=8),
    "CUDA 8 warps, 4 splits": _cuda(warps=8, trigger=0, num_splits=4),
    "CUDA 8 warps, 2 splits": _cuda(warps=8, trigger=0, num_splits=2),
    "CUDA 8 warps, 1 split": _cuda(warps=8, trigger=0, num_splits=1),
}


def int4_weights(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    qw = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k // 8), dtype=torch.int64, generator=gen).to(torch.int32)
    scale = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
    zero = (torch.rand(n, k // 32, generator=gen) * -0.1).to(torch.bfloat16)
    return qw.to(G.DEV), scale.to(G.DEV), zero.to(G.DEV)


def build(ctx: int, gen: torch.Generator) -> dict:
    pages = -(-(ctx + 1) // PAGE)
    blocks = pages + 1  # block 0 unused, as the pool keeps it
    kv = [(torch.randn(blocks, PAGE, HKV, D, generator=gen).to(torch.bfloat16).to(G.DEV),
           torch.randn(blocks, PAGE, HKV, D, generator=gen).to(torch.bfloat16).to(G.DEV)) for _ in range(LAYERS)]
    tables = torch.arange(1, pages + 1, dtype=torch.int64, device=G.DEV)[None]
    meta = AttnMetadata(query_start_loc=torch.tensor([0, 1], device=G.DEV), seq_lens=torch.tensor([ctx + 1], device=G.DEV),
                        block_tables=tables, slot_mapping=torch.tensor([ctx + PAGE], device=G.DEV), max_query_len=1,
                        max_seq_len=ctx + 1)
    return dict(kv=kv, meta=meta)


def chain(state: dict, weights: list, attn, x: torch.Tensor):
    def run():
        h = x
        for layer in range(LAYERS):
            qkv = q4c_linear(h, *weights[layer][0], **QKV)  # [1, 6144]
            q = qkv[:, :HQ * D].view(1, HQ, D)
            if attn is not None:
                k, v = state["kv"][layer]
                q = attn(q, k, v, state["meta"])
            h = q4c_linear(q.reshape(1, HQ * D), *weights[layer][1], **O_PROJ)
        return h
    return run


def graph_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return G.bench_ms(g.replay, inner=20, outer=5)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in VARIANTS if n != "no attention"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(res["contexts"])
    for i, ctx in enumerate(res["contexts"]):
        us = [res["contexts"][ctx][n]["attention_us_per_layer"] for n in names]  # (ctx: a string key in JSON)
        ax.barh([j + i * width for j in range(len(names))], us, height=width, label=f"{ctx} cached tokens")
    ax.set_yticks([j + width * (len(res["contexts"]) - 1) / 2 for j in range(len(names))], names, fontsize=8)
    ax.set_xlabel("attention cost per layer inside the int4 chain (us)")
    ax.set_title("8B-shape decode attention, batch 1, between int4 products (H200)")
    ax.invert_yaxis()
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/decode_attention.json")
    ap.add_argument("--contexts", default="128,512,4096")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    weights = [(int4_weights(HQ * D + 2 * HKV * D, HIDDEN, gen), int4_weights(HIDDEN, HQ * D, gen))
               for _ in range(LAYERS)]
    x = (torch.randn(1, HIDDEN, generator=gen) * 0.1).to(torch.bfloat16).to(G.DEV)
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, layers=LAYERS, contexts={})
    for ctx in [int(c) for c in args.contexts.split(",")]:
        state = build(ctx, gen)
        runs: dict[str, list[float]] = {n: [] for n in VARIANTS}
        q0 = (torch.randn(1, HQ, D, generator=gen)).to(torch.bfloat16).to(G.DEV)
        k0, v0 = state["kv"][0]
        ref = VARIANTS["Triton split + merge"](q0, k0, v0, state["meta"]).float()
        for rep in range(args.repeats):
            for name, attn in VARIANTS.items():
                fn = chain(state, weights, attn, x)
                if rep == 0 and attn not in (None, copy_q):  # every variant computes the same attention
                    err = ((attn(q0, k0, v0, state["meta"]).float() - ref).norm() / ref.norm()).item()
                    assert err < 1e-2, (name, err)
                runs[name].append(graph_ms(fn))
                G.log(f"ctx {ctx} [{rep}] {name:42s} {runs[name][-1] * 1e3:8.1f} us")
        base = min(runs["no attention"])
        res["contexts"][ctx] = {n: dict(chain_ms=min(t), runs=t, attention_us_per_layer=(min(t) - base) / LAYERS * 1e3)
                                for n, t in runs.items()}
        del state
    print(f"\n| variant | " + " | ".join(f"{c} tokens: chain ms, attention us/layer" for c in res["contexts"]) + " |")
    print("| --- |" + " --- |" * len(res["contexts"]))
    for n in VARIANTS:
        print(f"| {n} | " + " | ".join(f"{res['contexts'][c][n]['chain_ms']:.3f}, "
                                       f"{res['contexts'][c][n]['attention_us_per_layer']:.2f}"
                                       for c in res["contexts"]) + " |")
    plot(G.save(res, os.path.abspath(args.out)), os.path.splitext(args.out)[0] + ".png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
