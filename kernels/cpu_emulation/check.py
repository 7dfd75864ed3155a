"""Feeds moec's CUDA kernels, run by the CPU emulation (harness), random inputs and
compares them with independent torch references (HF-style RMSNorm, F.layer_norm, HF
rotate_half RoPE, F.silu, softmax + topk + renormalise, F.scaled_dot_product_attention over
the unpaged keys). Usage: check.py EMULATOR_BINARY DATA_DIR SLIDING_WINDOW (0 = none)."""
import sys, numpy as np, torch, subprocess, torch.nn.functional as F
torch.manual_seed(0); rng = np.random.default_rng(0)
EMU, D, WINDOW = sys.argv[1], sys.argv[2], int(sys.argv[3])
def w(name, a): a.tofile(f"{D}/{name}")
def r(name, dt, shape=None):
    a = np.fromfile(f"{D}/{name}", dtype=dt); return a.reshape(shape) if shape else a
# norm
n, dim = 5, 200
x = torch.randn(n, dim) * 3 + 0.5
wb = (torch.randn(dim) * 0.5 + 1).to(torch.bfloat16)
w("norm_x.f32", x.numpy()); w("norm_w.bf16", wb.view(torch.int16).numpy())
# rope
nt, h, kvh, hd, maxpos = 4, 8, 2, 16, 64
theta = 1e6; half = hd // 2
inv = 1.0 / (np.float32(theta) ** (np.arange(half, dtype=np.float32) * 2 / np.float32(hd)))
inv = inv.astype(np.float32)
ang = (np.arange(maxpos, dtype=np.float32)[:, None] * inv[None, :]).astype(np.float32)
cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
qkv = torch.randn(nt, (h + 2 * kvh) * hd); pos = np.array([0, 7, 33, 63], dtype=np.int32)
w("rope_qkv.f32", qkv.numpy()); w("rope_pos.i32", pos); w("rope_cos.f32", cos); w("rope_sin.f32", sin)
# swiglu
g = torch.randn(300) * 4; u = torch.randn(300)
w("swi_g.f32", g.numpy()); w("swi_u.f32", u.numpy())
# router
rn, ne, tk = 70, 16, 4
logits = torch.randn(rn, ne) * 2
logits[3] = 0.0  # all ties: lowest indices win
w("router_logits.f32", logits.numpy())
# attention
ns, ah, akvh, ahd, bs, nblocks, mb, win = 3, 8, 2, 32, 16, 20, 6, WINDOW
ctx = np.array([0, 17, 40], dtype=np.int32)
perm = rng.permutation(nblocks).astype(np.uint32)
tables = np.zeros((ns, mb), dtype=np.uint32); used = 0
for s in range(ns):
    nb = (ctx[s] + 1 + bs - 1) // bs
    tables[s, :nb] = perm[used:used + nb]; used += nb
kpool = np.zeros((nblocks, akvh, ahd, bs), dtype=np.float32)   # transposed keys
vpool = np.zeros((nblocks, akvh, bs, ahd), dtype=np.float32)
cached_k = [torch.randn(c, akvh, ahd) for c in ctx]; cached_v = [torch.randn(c, akvh, ahd) for c in ctx]
for s in range(ns):
    for p_ in range(ctx[s]):
        b, slot = tables[s, p_ // bs], p_ % bs
        kpool[b, :, :, slot] = cached_k[s][p_].numpy(); vpool[b, :, slot, :] = cached_v[s][p_].numpy()
aqkv = torch.randn(ns, (ah + 2 * akvh) * ahd)
w("attn_qkv.f32", aqkv.numpy()); w("attn_k.f32", kpool); w("attn_v.f32", vpool)
w("attn_tables.u32", tables); w("attn_ctx.i32", ctx)
maxkeys = int(ctx.max()) + 1
params = np.array([n, dim, nt, h, kvh, hd, rn, ne, tk, 1, ns, ah, akvh, ahd, bs, mb, maxkeys, win], dtype=np.int32)
w("params.i32", params)
subprocess.run([EMU, D], check=True)

def report(name, got, want):
    err = (torch.as_tensor(got) - want).abs().max().item()
    print(f"{name:10s} max abs err {err:.3e}"); assert err < 1e-4, name
wf = wb.float()
report("rms_norm", r("rms_out.f32", np.float32, (n, dim)), wf * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)))
report("layer_norm", r("ln_out.f32", np.float32, (n, dim)), F.layer_norm(x, (dim,), wf, None, 1e-5))
# HF apply_rotary_pos_emb with rotate_half
q = qkv.view(nt, h + 2 * kvh, hd).clone()
c = torch.from_numpy(np.concatenate([cos, cos], 1))[torch.from_numpy(pos).long()][:, None, :]
s_ = torch.from_numpy(np.concatenate([sin, sin], 1))[torch.from_numpy(pos).long()][:, None, :]
def rot_half(t): return torch.cat([-t[..., half:], t[..., :half]], -1)
want = q.clone(); qk = q[:, : h + kvh]; want[:, : h + kvh] = qk * c + rot_half(qk) * s_
report("rope", r("rope_out.f32", np.float32, (nt, (h + 2 * kvh) * hd)), want.view(nt, -1))
report("swiglu", r("swi_out.f32", np.float32), F.silu(g) * u)
probs = torch.softmax(logits, -1, dtype=torch.float)
tw, ti = torch.topk(probs, tk, -1)  # torch.topk ties are not ordered by index; check ties row separately
tw = tw / tw.sum(-1, keepdim=True)
ge, gw = r("router_experts.u32", np.uint32, (rn, tk)), r("router_weights.f32", np.float32, (rn, tk))
rows = [i for i in range(rn) if i != 3]
assert (torch.from_numpy(ge.astype(np.int64))[rows] == ti[rows]).all(), "router experts"
report("router_w", gw, tw)
assert list(ge[3]) == [0, 1, 2, 3] and np.allclose(gw[3], 0.25), (ge[3], gw[3])
# attention reference: SDPA over cached + new key per sequence, GQA via repeat_interleave
qv = aqkv.view(ns, ah + 2 * akvh, ahd)
out = r("attn_out.f32", np.float32, (ns, ah * ahd))
kp2, vp2 = r("attn_kpool.f32", np.float32, kpool.shape), r("attn_vpool.f32", np.float32, vpool.shape)
for s in range(ns):
    K = torch.cat([cached_k[s], qv[s, ah:ah + akvh][None]], 0)      # [T, kvh, hd]
    V = torch.cat([cached_v[s], qv[s, ah + akvh:][None]], 0)
    grp = ah // akvh
    if win > 0:
        K, V = K[-win:], V[-win:]
    Kq = K.repeat_interleave(grp, 1).permute(1, 0, 2); Vq = V.repeat_interleave(grp, 1).permute(1, 0, 2)
    Q = qv[s, :ah][:, None, :]
    o = F.scaled_dot_product_attention(Q, Kq, Vq)  # [h, 1, hd]
    report(f"attn s{s}", out[s].reshape(ah, ahd), o[:, 0])
    b, slot = tables[s, ctx[s] // bs], ctx[s] % bs
    assert np.array_equal(kp2[b, :, :, slot], qv[s, ah:ah + akvh].numpy()), "appended K"
    assert np.array_equal(vp2[b, :, slot, :], qv[s, ah + akvh:].numpy()), "appended V"
print(f"all kernels match the torch references (sliding window {win or 'none'})")
