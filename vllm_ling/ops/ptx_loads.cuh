// The global loads vllm-ling's CUDA kernels share (prepended to each kernel's source by
// vllm_ling.ops.cuda_jit.ptx_loads, after the #define lines; NVRTC sees one text, no include).
//
// ld_stream: 16 bytes of constant data read once per kernel (weights), through the non-coherent
// path without allocating in L1 (ld.global.nc.L1::no_allocate), so the stream does not evict the
// activations and partial sums a kernel reuses.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}
