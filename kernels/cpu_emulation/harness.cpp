// Runs each kernel of kernels/*.cu once under the CPU emulation (shim.h) on the inputs
// check.py wrote into DATA_DIR, and writes the outputs back there. Usage: harness DATA_DIR.
#include "shim.h"
#include <cstdio>
#include <string>
#include "prelude.cuh"
#include "rms_norm.cu"
#include "rope.cu"
#include "swiglu.cu"
#include "router_topk.cu"
#include "decode_attention.cu"
template <class T> std::vector<T> rd(const std::string& d, const char* n) {
    FILE* f = fopen((d + "/" + n).c_str(), "rb"); fseek(f, 0, SEEK_END); long s = ftell(f); fseek(f, 0, SEEK_SET);
    std::vector<T> v(s / sizeof(T)); fread(v.data(), 1, s, f); fclose(f); return v;
}
template <class T> void wr(const std::string& d, const char* n, const std::vector<T>& v) {
    FILE* f = fopen((d + "/" + n).c_str(), "wb"); fwrite(v.data(), sizeof(T), v.size(), f); fclose(f);
}
int main(int argc, char** argv) {
    std::string d = argv[1];
    auto p = rd<int>(d, "params.i32");  // shapes
    // norm: n_rows, dim
    { int n = p[0], dim = p[1];
      auto x = rd<float>(d, "norm_x.f32"); auto w = rd<unsigned short>(d, "norm_w.bf16");
      std::vector<float> o(x.size()), o2(x.size());
      launch({(unsigned)n}, {64}, [&] { rms_norm(x.data(), w.data(), o.data(), dim, 1e-5f, 0); });
      launch({(unsigned)n}, {96}, [&] { layer_norm(x.data(), w.data(), o2.data(), dim, 1e-5f, 0); });
      wr(d, "rms_out.f32", o); wr(d, "ln_out.f32", o2); }
    // rope: n_tok, heads, kv_heads, head_dim, max_pos
    { int n = p[2], h = p[3], kvh = p[4], hd = p[5];
      auto qkv = rd<float>(d, "rope_qkv.f32"); auto pos = rd<int>(d, "rope_pos.i32");
      auto c = rd<float>(d, "rope_cos.f32"); auto s = rd<float>(d, "rope_sin.f32");
      int width = (h + 2 * kvh) * hd;
      launch({(unsigned)n, (unsigned)(h + kvh)}, {32}, [&] { rope_neox(qkv.data(), pos.data(), c.data(), s.data(), width, h + kvh, hd); });
      wr(d, "rope_out.f32", qkv); }
    // swiglu
    { auto g = rd<float>(d, "swi_g.f32"); auto u = rd<float>(d, "swi_u.f32");
      launch({3}, {32}, [&] { swiglu(g.data(), u.data(), (int)g.size()); });
      wr(d, "swi_out.f32", g); }
    // router: n_tok, n_exp, top_k, norm_p(int: 0/1)
    { int n = p[6], e = p[7], k = p[8];
      auto lg = rd<float>(d, "router_logits.f32");
      std::vector<unsigned> ex(n * k); std::vector<float> wt(n * k);
      launch({(unsigned)((n + 31) / 32)}, {32}, [&] { router_topk(lg.data(), ex.data(), wt.data(), n, e, k, (float)p[9]); });
      wr(d, "router_experts.u32", ex); wr(d, "router_weights.f32", wt); }
    // attention: n_seqs, heads, kv_heads, hd, block_size, max_blocks, max_keys, window
    { int ns = p[10], h = p[11], kvh = p[12], hd = p[13], bs = p[14], mb = p[15], mk = p[16], win = p[17];
      auto qkv = rd<float>(d, "attn_qkv.f32"); auto kp = rd<float>(d, "attn_k.f32"); auto vp = rd<float>(d, "attn_v.f32");
      auto bt = rd<unsigned>(d, "attn_tables.u32"); auto cl = rd<int>(d, "attn_ctx.i32");
      std::vector<float> scores((size_t)ns * h * mk), out((size_t)ns * h * hd);
      const int rw = (h + 2 * kvh) * hd; // qkv rows without sinks (sink column -1)
      launch({(unsigned)ns, (unsigned)kvh}, {32}, [&] { paged_kv_append(qkv.data(), kp.data(), vp.data(), bt.data(), cl.data(), h, kvh, hd, bs, mb, rw); });
      // One split of mk keys (no combine); the append above already wrote the token's K/V.
      const unsigned chunks = (unsigned)((h / kvh + 7) / 8);
      launch({(unsigned)ns, (unsigned)kvh * chunks}, {128}, [&] { paged_decode_attention(qkv.data(), kp.data(), vp.data(), bt.data(), cl.data(), scores.data(), out.data(), h, kvh, hd, bs, mb, mk, win, 1.0f / std::sqrt((float)hd), rw, -1, 0); });
      wr(d, "attn_out.f32", out); wr(d, "attn_kpool.f32", kp); wr(d, "attn_vpool.f32", vp); }
    return 0;
}
