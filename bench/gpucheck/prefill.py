"""Prefill on the device: a Llama-3.1-8B-shaped forward of T prompt tokens
(random BF16 weights, flash attention, CUDA graphs), and the peak activation
memory of an 8192-token forward, which vLLM's block arithmetic subtracts."""
import json
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

H, LAYERS, NH, NKV, HD, FF, VOCAB = 4096, 32, 32, 8, 128, 14336, 128256
dev, dt = "cuda", torch.bfloat16


def out(**kw):
    print(json.dumps(kw), flush=True)


def w(*shape):
    return torch.randn(*shape, dtype=dt, device=dev) * 0.02


embed, lm_head = w(VOCAB, H), w(VOCAB, H)
layers = [dict(qkv=w(H + 2 * NKV * HD, H), o=w(H, H), gu=w(2 * FF, H), down=w(H, FF),
               n1=torch.ones(H, dtype=dt, device=dev), n2=torch.ones(H, dtype=dt, device=dev)) for _ in range(LAYERS)]
norm = torch.ones(H, dtype=dt, device=dev)
torch.cuda.synchronize()
wbytes = torch.cuda.memory_allocated()
free, total = torch.cuda.mem_get_info()
out(kind="weights", allocated=wbytes, total=total, free=free)


def rms(x, g):
    v = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(v + 1e-5)).to(dt) * g


def prefill(ids):
    T = ids.shape[0]
    h = embed[ids]
    for l in layers:
        a = rms(h, l["n1"])
        qkv = a @ l["qkv"].t()
        q = qkv[:, :H].view(1, T, NH, HD).transpose(1, 2)
        k = qkv[:, H:H + NKV * HD].view(1, T, NKV, HD).transpose(1, 2)
        v = qkv[:, H + NKV * HD:].view(1, T, NKV, HD).transpose(1, 2)
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = h + o.transpose(1, 2).reshape(T, H) @ l["o"].t()
        a = rms(h, l["n2"])
        gu = a @ l["gu"].t()
        h = h + (F.silu(gu[:, :FF]) * gu[:, FF:]) @ l["down"].t()
    return torch.argmax(rms(h[-1:], norm) @ lm_head.t(), dim=-1)


# vLLM's profile run: one forward of max_num_batched_tokens, peak memory kept.
ids = torch.randint(0, VOCAB, (8192,), device=dev)
torch.cuda.reset_peak_memory_stats()
prefill(ids)
torch.cuda.synchronize()
out(kind="peak", tokens=8192, peak_allocated=torch.cuda.max_memory_allocated(), activation=torch.cuda.max_memory_allocated() - wbytes)


def timed(fn, reps=10, warm=2):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]


for T in (256, 512, 1024, 2048, 4096, 8192):
    try:
        ids = torch.randint(0, VOCAB, (T,), device=dev)
        s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            prefill(ids); prefill(ids)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            prefill(ids)
        med = timed(g.replay)
        flops = 2 * (wbytes / 2 - 2 * VOCAB * H) * T
        out(kind="prefill", tokens=T, median_ms=med, us_per_token=med * 1e3 / T, linear_tflops=flops / (med / 1e3) / 1e12)
        del g
        torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        out(kind="error", what=f"prefill {T}", err=repr(e)[:400])
out(kind="done")
