
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

__device__ __forceinline__ void decode_word(u32 q, u32 (&a)[4]) {
  const u32 M = 0x81C081C0u;
  a[0] = q & M;
  a[1] = __funnelshift_l(q, q, 4) & M;
  a[2] = __funnelshift_l(q, q, 10) & M;
  a[3] = (__funnelshift_l(q, q, 14) & 0x81808180u) | (__funnelshift_l(q, q, 6) & 0x00400040u);
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1,
                                         float c0, float c1, float c2, float c3) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1),
        "f"(c0), "f"(c1), "f"(c2), "f"(c3));
}

// x * 2**100 on a BF16 pair (exact): products stay normal FP32 inside the MMA
__device__ __forceinline__ u32 scale_up(u32 v) {
  u32 r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x71807180u), "r"(0x80008000u));
  return r;
}

// E8M0 byte s -> 2**(s-127) * 2**(126-100)
__device__ __forceinline__ float group_factor(u32 s) {
  return __int_as_float((int)((s + 26u) << 23));
}

// byte j of w as that factor: one byte permute (ALU) and one IMAD
__device__ __forceinline__ float byte_factor(u32 w, int j) {
  return __int_as_float((int)(__byte_perm(w, 0u, 0x4440u + j) * (1u << 23) + (26u << 23)));
}

// Ling's routed-expert SwiGLU with the per-layer clamp: CLAMP_GATE_OUTPUT 1 clamps the gate
// output, min(silu(g), L) * clamp(u) (as trained; what vllm-ling serves), 0 the gate input,
// silu(min(g, L)) * clamp(u) (vLLM 0.32's fused MoE); vllm_ling/ops/moe/activation.py
__device__ __forceinline__ float swiglu(float g, float u, float limit, int has_limit) {
  if (has_limit) {
    u = fminf(fmaxf(u, -limit), limit);
    if (!CLAMP_GATE_OUTPUT) g = fminf(g, limit);
  }
  float y = g / (1.f + expf(-g));
  if (has_limit && CLAMP_GATE_OUTPUT) y = fminf(y, limit);
  return y * u;
}

__device__ __forceinline__ u16 to_bf16(float v) {
  u16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
  return r;
}

