// Greedy generation with llama.cpp's own library, for moec's GGUF parity checks
// (scripts/gguf_fixtures.sh builds it against the llama-cpp-python sdist's llama.cpp).
// Usage: llama_greedy MODEL.gguf N_NEW TOKEN_ID... ; prints one JSON object:
// {"tokens": [generated ids], "first_logits": [logits after the prompt]}.
// The prompt is given as token ids so both systems start from the same ids, whatever
// their tokenizers do.
#include "llama.h"
#include <cstdio>
#include <cstdlib>
#include <vector>

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
