// ggml's own K-quant bytes for a fixed matrix, the golden data of moec's encoder tests
// (src/model/quant/encode.rs). Built and run by scripts/kquant_golden.sh against the
// libggml-base.a that scripts/gguf_fixtures.sh builds (llama-cpp-python 0.3.36's ggml).
// Writes to stdout: ROWS x COLS f32 weights (little-endian), then the matrix as Q4_K, Q5_K,
// Q6_K and Q5_0 via ggml_quantize_chunk with no importance matrix, which is what
// llama-quantize runs (quantize_row_q{4,5,6}_K_ref, quantize_row_q5_0_ref).
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "ggml.h"

enum { ROWS = 8, COLS = 512 };

static uint64_t state = 0x9e3779b97f4a7c15ull;

// Uniform in [-0.5, 0.5): the top 24 bits of a 64-bit LCG.
static float uniform(void) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)(state >> 40) / 16777216.0f - 0.5f;
}

int main(void) {
    static float x[ROWS * COLS];
    for (int r = 0; r < ROWS; ++r) {
        for (int c = 0; c < COLS; ++c) {
            float u = uniform();
            float v;
            switch (r) {
                case 0: v = 0.05f * u; break;                                    // small, centred
                case 1: v = 0.02f * u * (c % 37 == 0 ? 12.0f : 1.0f); break;     // spikes
                case 2: v = 0.3f + 0.1f * u; break;                               // all positive
                case 3: v = -0.2f + 0.05f * u; break;                             // all negative
                case 4: v = (c / 32) % 3 == 1 ? 0.0f : 0.1f * u; break;           // zero sub-blocks
                case 5: v = (c % 5 == 0) ? 1e-20f * u : 0.0f; break;              // below GROUP_MAX_EPS
                case 6: v = (c < 256) ? 0.5f : -0.25f; break;                     // constant halves
                default: v = u * powf(10.0f, (float)((c / 16) % 7) - 3.0f); break; // scales 1e-3..1e3
            }
            x[r * COLS + c] = v;
        }
    }
    fwrite(x, sizeof(float), ROWS * COLS, stdout);
    const enum ggml_type types[] = {GGML_TYPE_Q4_K, GGML_TYPE_Q5_K, GGML_TYPE_Q6_K, GGML_TYPE_Q5_0};
    for (int t = 0; t < 4; ++t) {
        size_t size = ggml_row_size(types[t], COLS) * ROWS;
        void * out = calloc(1, size);
        size_t written = ggml_quantize_chunk(types[t], x, out, 0, ROWS, COLS, NULL);
        if (written != size) {
            fprintf(stderr, "%s: %zu bytes, expected %zu\n", ggml_type_name(types[t]), written, size);
            return 1;
        }
        fwrite(out, 1, size, stdout);
        free(out);
    }
    return 0;
}
