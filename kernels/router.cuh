// The MoE router's choice for one token (router_topk.cu's, and the fused gate of
// moe_grouped.cu's moe_gate_route): included by both, so the selection exists once.

#define ROUTER_MAX_EXPERTS 256

// Entry i's choice into experts[i] / weights[i] (each when not null) and, when `route` is
// not null, into the packed route (backend::decode_routing's layout: per entry the expert
// then its weight's bits), so the router's launch writes the route itself instead of a
// route_pack launch after it.
__device__ __forceinline__ void moec_route_store(unsigned int* experts, float* weights,
                                                 unsigned int* route, size_t i,
                                                 unsigned int expert, float weight) {
    if (experts != 0) {
        experts[i] = expert;
    }
    if (weights != 0) {
        weights[i] = weight;
    }
    if (route != 0) {
        route[2 * i] = expert;
        route[2 * i + 1] = __float_as_uint(weight);
    }
}

// The indices of the top_k largest of values[0..n) into chosen[0..top_k), largest first,
// by repeated arg-max: a strictly greater value wins, so equal values go to the lower index,
// the CPU's sort order. n <= ROUTER_MAX_EXPERTS.
__device__ __forceinline__ void moec_topk_select(const float* values, int n, int top_k,
                                                 unsigned int* chosen) {
    bool taken[ROUTER_MAX_EXPERTS];
    for (int e = 0; e < n; ++e) {
        taken[e] = false;
    }
    for (int k = 0; k < top_k; ++k) {
        int best = -1;
        for (int e = 0; e < n; ++e) {
            if (taken[e]) {
                continue;
            }
            if (best < 0 || values[e] > values[best]) {
                best = e;
            }
        }
        taken[best] = true;
        chosen[k] = (unsigned int)best;
    }
}

// Token `token`'s choice from its `n_experts` logits at `row` (global or shared memory):
// softmax in f32, top-k with ties to the lower expert index, division by the p-norm of the
// chosen probabilities when norm_p > 0, stored by moec_route_store. One thread's work
// (experts are few); the caller checks n_experts <= ROUTER_MAX_EXPERTS and top_k <=
// n_experts.
__device__ void moec_route_topk(const float* row, int n_experts, int top_k, float norm_p,
                                unsigned int* experts, float* weights, unsigned int* route,
                                size_t token) {
    float probs[ROUTER_MAX_EXPERTS];
    float max = __int_as_float(0xff800000); // -inf
    for (int e = 0; e < n_experts; ++e) {
        max = fmaxf(max, row[e]);
    }
    float sum = 0.0f;
    for (int e = 0; e < n_experts; ++e) {
        probs[e] = expf(row[e] - max);
        sum += probs[e];
    }
    for (int e = 0; e < n_experts; ++e) {
        probs[e] = probs[e] / sum;
    }
    unsigned int chosen[ROUTER_MAX_EXPERTS];
    moec_topk_select(probs, n_experts, top_k, chosen);
    float denom = 1.0f;
    if (norm_p > 0.0f) {
        double acc = 0.0;
        for (int k = 0; k < top_k; ++k) {
            acc += pow(fabs((double)probs[chosen[k]]), (double)norm_p);
        }
        denom = (float)pow(acc, 1.0 / (double)norm_p);
    }
    for (int k = 0; k < top_k; ++k) {
        moec_route_store(experts, weights, route, (size_t)token * top_k + k, chosen[k],
                         probs[chosen[k]] / denom);
    }
}
