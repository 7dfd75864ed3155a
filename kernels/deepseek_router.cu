// DeepSeek's routers on the device, as route_deepseek() in
// src/math/deepseek_route.rs decides (transformers' DeepseekV2TopkRouter and
// DeepseekV3TopkRouter; read its header):
//   mode 0 (greedy) and 1 (group_limited_greedy), DeepSeek-V2: softmax over all experts
//     (exp(v - max) / sum, summed in expert order); mode 1 keeps the topk_group groups with
//     the highest expert score and sets the others' scores to 0; the top_k scores, times
//     routed_scaling_factor.
//   mode 2 (noaux_tc), DeepSeek-V3: sigmoid scores; selection by score + bias among the
//     topk_group groups with the highest sum of their two best biased scores (the others
//     masked to -inf); weights are the unbiased scores, divided by their sum + 1e-20 when
//     norm_topk_prob, times routed_scaling_factor.
// Every top-k (groups, experts) is a repeated arg-max where only a strictly greater value
// wins, so ties go to the lower index: the CPU's sort order.
//
//   deepseek_route     logits -> the packed route
//   deepseek_no_route  a dense layer's route: every slot NO_EXPERT (0xffffffff), weight 0
//                      (math::dense::no_expert_routing), which the grouping and combine
//                      kernels skip
//
// Layout: logits is [n_tokens, n_experts] f32; bias is n_experts f32 (0: none);
// `route` is the packed route of backend::decode_routing ([n_tokens * top_k] pairs of an
// expert u32 and its f32 weight's bits, highest choice first). n_experts <= 
// DEEPSEEK_MAX_EXPERTS, top_k <= n_experts, n_group divides into n_experts: the host
// checks all three (DeepSeek-V3: 256 experts in 8 groups, top-8).
// Launch: deepseek_route: 1-D grid, one thread per token. deepseek_no_route: any 1-D grid,
// grid-stride loop over n_entries.

#define DEEPSEEK_MAX_EXPERTS 256

// The index of the largest values[i] not yet taken (ties to the lower index); marks it.
__device__ int deepseek_take_max(const float* values, bool* taken, int n) {
    int best = -1;
    for (int i = 0; i < n; ++i) {
        if (taken[i]) {
            continue;
        }
        if (best < 0 || values[i] > values[best]) {
            best = i;
        }
    }
    if (best >= 0) {
        taken[best] = true;
    }
    return best;
}

// Keeps the topk_group groups ranked highest by their score (mode 2: sum of the two best
// values, else the best value) and sets every value outside them to `masked`.
__device__ void deepseek_mask_groups(float* values, int n_experts, int n_group, int topk_group, int two_best, float masked) {
    const int per_group = n_experts / (n_group > 0 ? n_group : 1);
    if (n_group <= 1 || per_group == 0) {
        return;
    }
    float group_score[DEEPSEEK_MAX_EXPERTS];
    bool taken[DEEPSEEK_MAX_EXPERTS];
    for (int g = 0; g < n_group; ++g) {
        const float* group = values + g * per_group;
        if (two_best) {
            for (int i = 0; i < per_group; ++i) {
                taken[i] = false;
            }
            const int first = deepseek_take_max(group, taken, per_group);
            const int second = deepseek_take_max(group, taken, per_group);
            float sum = 0.0f;
            sum += group[first];
            if (second >= 0) {
                sum += group[second];
            }
            group_score[g] = sum;
        } else {
            float best = __int_as_float(0xff800000);
            for (int i = 0; i < per_group; ++i) {
                best = fmaxf(best, group[i]);
            }
            group_score[g] = best;
        }
    }
    for (int g = 0; g < n_group; ++g) {
        taken[g] = false;
    }
    for (int j = 0; j < topk_group && j < n_group; ++j) {
        deepseek_take_max(group_score, taken, n_group);
    }
    for (int g = 0; g < n_group; ++g) {
        if (!taken[g]) {
            for (int i = 0; i < per_group; ++i) {
                values[g * per_group + i] = masked;
            }
        }
    }
}

extern "C" __global__ void deepseek_route(
    const float* __restrict__ logits,
    const float* __restrict__ bias,
    unsigned int* __restrict__ route,
    int n_tokens,
    int n_experts,
    int top_k,
    int mode,
    int n_group,
    int topk_group,
    int norm_topk_prob,
    float scaling) {
    const int token = blockIdx.x * blockDim.x + threadIdx.x;
    if (token >= n_tokens || n_experts > DEEPSEEK_MAX_EXPERTS || top_k > n_experts) {
        return;
    }
    const float* row = logits + (size_t)token * n_experts;
    float scores[DEEPSEEK_MAX_EXPERTS];
    float choice[DEEPSEEK_MAX_EXPERTS];
    bool taken[DEEPSEEK_MAX_EXPERTS];
    int chosen[DEEPSEEK_MAX_EXPERTS];
    float picked[DEEPSEEK_MAX_EXPERTS];
    if (mode == 2) {
        for (int e = 0; e < n_experts; ++e) {
            scores[e] = 1.0f / (1.0f + expf(-row[e]));
            choice[e] = scores[e] + (bias != 0 ? bias[e] : 0.0f);
        }
        deepseek_mask_groups(choice, n_experts, n_group, topk_group, 1, __int_as_float(0xff800000));
    } else {
        float max = __int_as_float(0xff800000);
        for (int e = 0; e < n_experts; ++e) {
            max = fmaxf(max, row[e]);
        }
        float sum = 0.0f;
        for (int e = 0; e < n_experts; ++e) {
            scores[e] = expf(row[e] - max);
            sum += scores[e];
        }
        for (int e = 0; e < n_experts; ++e) {
            scores[e] = scores[e] / sum;
        }
        if (mode == 1) {
            deepseek_mask_groups(scores, n_experts, n_group, topk_group, 0, 0.0f);
        }
        for (int e = 0; e < n_experts; ++e) {
            choice[e] = scores[e];
        }
    }
    for (int e = 0; e < n_experts; ++e) {
        taken[e] = false;
    }
    for (int k = 0; k < top_k; ++k) {
        chosen[k] = deepseek_take_max(choice, taken, n_experts);
        picked[k] = scores[chosen[k]];
    }
    if (mode == 2 && norm_topk_prob) {
        float denominator = 0.0f;
        for (int k = 0; k < top_k; ++k) {
            denominator += picked[k];
        }
        denominator += 1e-20f;
        for (int k = 0; k < top_k; ++k) {
            picked[k] = picked[k] / denominator;
        }
    }
    unsigned int* dst = route + (size_t)token * top_k * 2;
    for (int k = 0; k < top_k; ++k) {
        dst[2 * k] = (unsigned int)chosen[k];
        dst[2 * k + 1] = __float_as_uint(picked[k] * scaling);
    }
}

extern "C" __global__ void deepseek_no_route(unsigned int* __restrict__ route, long long n_entries) {
    const long long stride = (long long)blockDim.x * gridDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n_entries; i += stride) {
        route[2 * i] = 0xffffffffu;
        route[2 * i + 1] = 0u;
    }
}
