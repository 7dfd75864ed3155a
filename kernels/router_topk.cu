// The MoE router's decision, as route() in src/math/moe.rs makes it: softmax over
// all experts in f32 (exp(v - max) / sum), top-k with ties to the lower expert index, then
// division by the p-norm of the chosen probabilities when norm_p > 0 (Mixtral and DBRX:
// p = 1, the sum), the norm taken in double as the CPU does; norm_p <= 0 keeps the raw
// probabilities.
//
// Layout: logits is [n_tokens, n_experts] f32 (the router's output); experts and weights
// are [n_tokens, top_k], highest probability first (unsigned int expert index, f32 weight),
// each written when not null; `route` (when not null) the same choices packed as
// [n_tokens * top_k] (expert, weight bits) pairs.
// n_experts must be at most ROUTER_MAX_EXPERTS and top_k at most n_experts: the caller
// checks both (Mixtral has 8 experts, DBRX 16, Qwen3-30B-A3B and gpt-oss-120b 128).
// Launch: 1-D grid, one thread per token (experts are few; a token's work is tiny).

#include "router.cuh"

extern "C" __global__ void router_topk(
    const float* __restrict__ logits,
    unsigned int* __restrict__ experts,
    float* __restrict__ weights,
    int n_tokens,
    int n_experts,
    int top_k,
    float norm_p,
    unsigned int* __restrict__ route) {
    const int token = blockIdx.x * blockDim.x + threadIdx.x;
    if (token >= n_tokens || n_experts > ROUTER_MAX_EXPERTS || top_k > n_experts) {
        return;
    }
    moec_route_topk(logits + (size_t)token * n_experts, n_experts, top_k, norm_p, experts,
                    weights, route, (size_t)token);
}

// gpt-oss's routing, as route_topk_softmax() in moe.rs: top-k of the raw logits (router
// bias already added; ties to the lower expert index), then softmax over the k chosen
// only (exp(v - max) / sum, max = the first chosen). Same layout, limits and launch as
// router_topk.
extern "C" __global__ void router_topk_softmax(
    const float* __restrict__ logits,
    unsigned int* __restrict__ experts,
    float* __restrict__ weights,
    int n_tokens,
    int n_experts,
    int top_k,
    unsigned int* __restrict__ route) {
    const int token = blockIdx.x * blockDim.x + threadIdx.x;
    if (token >= n_tokens || n_experts > ROUTER_MAX_EXPERTS || top_k > n_experts || top_k < 1) {
        return;
    }
    const float* row = logits + (size_t)token * n_experts;
    unsigned int chosen[ROUTER_MAX_EXPERTS];
    moec_topk_select(row, n_experts, top_k, chosen);
    const float max = row[chosen[0]];
    float exps[ROUTER_MAX_EXPERTS];
    float sum = 0.0f;
    for (int k = 0; k < top_k; ++k) {
        exps[k] = expf(row[chosen[k]] - max);
        sum += exps[k];
    }
    for (int k = 0; k < top_k; ++k) {
        moec_route_store(experts, weights, route, (size_t)token * top_k + k, chosen[k],
                         exps[k] / sum);
    }
}
