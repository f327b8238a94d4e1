"""Decode steps of a Llama-3.1-8B-shaped model (random BF16 weights, CUDA
graphs) for a grid of batch sizes and context lengths, and the HBM read
bandwidth: what the simulator's step-time model is checked against
(docs/simulator.md, "Checked on a real H200"). Prints one JSON object per
line. PyTorch's own kernels, not vLLM's: no fused norms, no paged KV."""
import json
import torch
import torch.nn.functional as F

H, LAYERS, NH, NKV, HD, FF, VOCAB = 4096, 32, 32, 8, 128, 14336, 128256
dev = "cuda"
dt = torch.bfloat16
torch.manual_seed(0)


def out(**kw):
    print(json.dumps(kw), flush=True)


p = torch.cuda.get_device_properties(0)
free, total = torch.cuda.mem_get_info()
out(kind="device", name=p.name, sms=p.multi_processor_count, total_bytes=total, free_bytes=free,
    torch=torch.__version__, cuda=torch.version.cuda)


def timed(fn, reps=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2], ts[0]


# HBM read bandwidth: sum a 16 GiB tensor.
x = torch.empty(8 << 30, dtype=dt, device=dev).normal_()
med, best = timed(lambda: x.sum(dtype=torch.float32), reps=10)
out(kind="bandwidth", what="sum of 16 GiB bf16", bytes=x.numel() * 2, median_ms=med,
    read_tb_s=x.numel() * 2 / (med / 1e3) / 1e12)
med, best = timed(lambda: x[: 4 << 30].copy_(x[4 << 30:]), reps=10)
out(kind="bandwidth", what="copy 8 GiB", bytes=16 << 30, median_ms=med,
    rw_tb_s=(16 << 30) / (med / 1e3) / 1e12)
del x
torch.cuda.empty_cache()


def w(*shape):
    return (torch.randn(*shape, dtype=dt, device=dev) * 0.02)


embed = w(VOCAB, H)
lm_head = w(VOCAB, H)
layers = []
for _ in range(LAYERS):
    layers.append(dict(
        qkv=w(H + 2 * NKV * HD, H), o=w(H, H), gu=w(2 * FF, H), down=w(H, FF),
        n1=torch.ones(H, dtype=dt, device=dev), n2=torch.ones(H, dtype=dt, device=dev)))
norm = torch.ones(H, dtype=dt, device=dev)
wbytes = sum(t.numel() * 2 for l in layers for t in l.values()) + embed.numel() * 2 + lm_head.numel() * 2
out(kind="weights", bytes=wbytes)


def rms(x, g):
    v = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(v + 1e-5)).to(dt) * g


MAXTOK = 420_000  # context tokens held across all sequences (55 GB of KV)
kvbuf = torch.empty(LAYERS, 2, MAXTOK * NKV * HD, dtype=dt, device=dev).normal_()
out(kind="kv", bytes=kvbuf.numel() * 2, per_token=2 * LAYERS * NKV * HD * 2)


def decode_fn(B, L, attn, use_sdpa):
    ids = torch.randint(0, VOCAB, (B,), device=dev)
    Ks = [kvbuf[i, 0, : B * L * NKV * HD].view(B, NKV, L, HD) for i in range(LAYERS)]
    Vs = [kvbuf[i, 1, : B * L * NKV * HD].view(B, NKV, L, HD) for i in range(LAYERS)]
    res = {}

    def fwd():
        h = embed[ids]
        for i, l in enumerate(layers):
            a = rms(h, l["n1"])
            qkv = a @ l["qkv"].t()
            q = qkv[:, :H]
            if attn:
                if use_sdpa:
                    o = F.scaled_dot_product_attention(q.view(B, NH, 1, HD), Ks[i], Vs[i], enable_gqa=True)
                else:
                    q4 = q.view(B, NKV, NH // NKV, HD)
                    s = torch.matmul(q4, Ks[i].transpose(-1, -2)) * (HD ** -0.5)
                    o = torch.matmul(torch.softmax(s, dim=-1), Vs[i])
                o = o.reshape(B, H)
            else:
                o = q
            h = h + o @ l["o"].t()
            a = rms(h, l["n2"])
            gu = a @ l["gu"].t()
            h = h + (F.silu(gu[:, :FF]) * gu[:, FF:]) @ l["down"].t()
        logits = rms(h, norm) @ lm_head.t()
        res["next"] = torch.argmax(logits, dim=-1)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fwd()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fwd()
    return g.replay


grid = [(1, 256), (1, 1024), (1, 4096), (1, 16384), (1, 32768), (1, 65536), (1, 125000),
        (8, 1024), (8, 4096), (8, 22000),
        (32, 1024), (32, 4096), (64, 512), (64, 1024), (64, 4096),
        (128, 1024), (128, 2048), (256, 512), (256, 1024), (256, 1536)]

sdpa_ok = True
try:
    decode_fn(2, 64, True, True)()
    torch.cuda.synchronize()
except Exception as e:  # noqa: BLE001
    sdpa_ok = False
    out(kind="note", sdpa_gqa_failed=repr(e)[:300])

for B in (1, 64, 256):
    try:
        rep = decode_fn(B, 16, False, False)
        med, best = timed(rep)
        out(kind="linear_only", seqs=B, median_ms=med, best_ms=best)
        del rep
    except Exception as e:  # noqa: BLE001
        out(kind="error", what=f"linear_only {B}", err=repr(e)[:300])

for B, L in grid:
    if B * L > MAXTOK:
        continue
    for use_sdpa in ([True, False] if sdpa_ok and B * L in (1 * 32768, 64 * 1024, 256 * 1024) else [sdpa_ok]):
        try:
            rep = decode_fn(B, L, True, use_sdpa)
            med, best = timed(rep)
            out(kind="decode", seqs=B, context=L, context_tokens=B * L, attention="sdpa" if use_sdpa else "bmm",
                median_ms=med, best_ms=best)
            del rep
        except Exception as e:  # noqa: BLE001
            out(kind="error", what=f"decode {B}x{L}", err=repr(e)[:300])
        torch.cuda.empty_cache()

out(kind="done")
