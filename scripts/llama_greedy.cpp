// Greedy generation with llama.cpp's own library, for moec's GGUF parity checks
// (scripts/gguf_fixtures.sh builds it against the llama-cpp-python sdist's llama.cpp).
// Usage: llama_greedy MODEL.gguf N_NEW TOKEN_ID... ; prints one JSON object:
// {"tokens": [generated ids], "first_logits": [logits after the prompt]}.
// The prompt is given as token ids so both systems start from the same ids, whatever
// their tokenizers do.
// With LLAMA_GREEDY_DUMP=FILE set, every contiguous f32 tensor of the first step's graph
// (ggml's names: attn_norm-0, kqv_out-0, ffn_moe_out-1, l_out-1, result_output, ...) is
// written to FILE through llama.cpp's eval callback, for finding where two
// implementations part layer by layer: records of u32 name length, the name, 4 x i64 ne,
// then ne0*ne1*ne2*ne3 f32 values. The fixtures are made without it: the callback makes
// ggml evaluate node by node.
#include "llama.h"
#include "ggml-backend.h"
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

// The dump file while the first step runs; null otherwise.
static FILE * g_dump = nullptr;

static bool dump_tensor(struct ggml_tensor * t, bool ask, void *) {
    const bool wanted = g_dump && t->type == GGML_TYPE_F32 && t->name[0] && ggml_is_contiguous(t);
    // Asked first whether we want a node's data; then called once it is computed, where
    // returning false would stop the graph.
    if (ask) return wanted;
    if (!wanted) return true;
    std::vector<float> buf(ggml_nelements(t));
    ggml_backend_tensor_get(t, buf.data(), 0, ggml_nbytes(t));
    const uint32_t len = (uint32_t) strlen(t->name);
    fwrite(&len, 4, 1, g_dump);
    fwrite(t->name, 1, len, g_dump);
    for (int i = 0; i < 4; i++) { const int64_t ne = t->ne[i]; fwrite(&ne, 8, 1, g_dump); }
    fwrite(buf.data(), 4, buf.size(), g_dump);
    return true;
}

int main(int argc, char ** argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s MODEL.gguf N_NEW TOKEN_ID...\n", argv[0]);
        return 2;
    }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    llama_context_params cp = llama_context_default_params();
    cp.n_ctx = 512;
    cp.n_batch = 512;
    cp.n_threads = 1;
    cp.n_threads_batch = 1;
    // LLAMA_GREEDY_ATTN=f32: attention all in f32 (f32 KV cache, flash attention off).
    // By default llama.cpp's CPU attention is flash attention on f16 K and V (it casts
    // even an f32 cache to f16), with Q rounded to f16 and V accumulated in f16; moec's
    // attention is f32, so this variant isolates that one difference.
    const char * attn = getenv("LLAMA_GREEDY_ATTN");
    if (attn && strcmp(attn, "f32") == 0) {
        cp.type_k = GGML_TYPE_F32;
        cp.type_v = GGML_TYPE_F32;
        cp.flash_attn_type = LLAMA_FLASH_ATTN_TYPE_DISABLED;
    } else if (attn) {
        fprintf(stderr, "LLAMA_GREEDY_ATTN must be f32 or unset, not %s\n", attn);
        return 2;
    }
    const char * dump_path = getenv("LLAMA_GREEDY_DUMP");
    if (dump_path) {
        g_dump = fopen(dump_path, "wb");
        if (!g_dump) { fprintf(stderr, "cannot write %s\n", dump_path); return 1; }
        cp.cb_eval = dump_tensor;
        cp.cb_eval_user_data = nullptr;
    }
    llama_context * ctx = llama_init_from_model(model, cp);
    if (!ctx) { fprintf(stderr, "cannot create a context\n"); return 1; }
    const int n_vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
    const int n_new = atoi(argv[2]);
    std::vector<llama_token> prompt;
    for (int i = 3; i < argc; i++) prompt.push_back((llama_token) atoi(argv[i]));
    std::vector<llama_token> out;
    llama_batch batch = llama_batch_get_one(prompt.data(), (int32_t) prompt.size());
    llama_token next = 0;
    printf("{\"first_logits\": [");
    for (int step = 0; step < n_new; step++) {
        if (llama_decode(ctx, batch) != 0) { fprintf(stderr, "decode failed\n"); return 1; }
        if (g_dump) { fclose(g_dump); g_dump = nullptr; }
        const float * logits = llama_get_logits_ith(ctx, -1);
        int best = 0;
        for (int t = 1; t < n_vocab; t++) if (logits[t] > logits[best]) best = t;
        if (step == 0) {
            for (int t = 0; t < n_vocab; t++) printf(t ? ", %.7g" : "%.7g", logits[t]);
        }
        next = best;
        out.push_back(next);
        batch = llama_batch_get_one(&next, 1);
    }
    printf("], \"tokens\": [");
    for (size_t i = 0; i < out.size(); i++) printf(i ? ", %d" : "%d", out[i]);
    printf("]}\n");
    llama_free(ctx);
    llama_model_free(model);
    return 0;
}
