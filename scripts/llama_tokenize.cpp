// Tokenisation with llama.cpp's own library, the golden for moec's GGUF pre-tokenizers
// (scripts/gguf_fixtures.sh builds it against the llama-cpp-python sdist's llama.cpp).
// Usage: llama_tokenize VOCAB.gguf < TEXTS ; TEXTS are UTF-8 texts each ended by a NUL
// byte. Loads the vocabulary only and prints one JSON array per text, one line each:
// the token ids llama.cpp gives it (no BOS/EOS added, special tokens not parsed).
#include "llama.h"
#include <cstdio>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

int main(int argc, char ** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s VOCAB.gguf < NUL-ended texts\n", argv[0]);
        return 2;
    }
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.vocab_only = true;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const llama_vocab * vocab = llama_model_get_vocab(model);
    std::string all((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    size_t start = 0;
    while (start < all.size()) {
        size_t end = all.find('\0', start);
        if (end == std::string::npos) end = all.size();
        const std::string text = all.substr(start, end - start);
        std::vector<llama_token> ids(text.size() + 8);
        int n = llama_tokenize(vocab, text.data(), (int) text.size(), ids.data(), (int) ids.size(), false, false);
        if (n < 0) { fprintf(stderr, "tokenize failed\n"); return 1; }
        printf("[");
        for (int i = 0; i < n; i++) printf(i ? ",%d" : "%d", ids[i]);
        printf("]\n");
        start = end + 1;
    }
    llama_model_free(model);
    return 0;
}
