// Instantiations of the sampling kernels. Host names:
// sample_tokens[_biased]_<logits dtype>_<token dtype> and
// verify_sampled_<logits dtype>_<token dtype>, as csrc/metal/sampling.cpp
// builds them.
#include "sampling.h"

#define instantiate_sampling(dname, key, tname, tok)                   \
  template [[host_name("sample_tokens_" #dname "_" #tname)]] [[kernel]]  \
  decltype(mtplx::sample_tokens<mtplx::key, tok>)                        \
      mtplx::sample_tokens<mtplx::key, tok>;                             \
  template [[host_name("sample_tokens_biased_" #dname "_" #tname)]]      \
  [[kernel]] decltype(mtplx::sample_tokens_biased<mtplx::key, tok>)      \
      mtplx::sample_tokens_biased<mtplx::key, tok>;                      \
  template [[host_name("verify_sampled_" #dname "_" #tname)]] [[kernel]] \
  decltype(mtplx::verify_sampled<mtplx::key, tok>)                       \
      mtplx::verify_sampled<mtplx::key, tok>;

#define instantiate_sampling_tokens(dname, key)   \
  instantiate_sampling(dname, key, int32, int)    \
  instantiate_sampling(dname, key, int64, long)

instantiate_sampling_tokens(float32, F32Key)
instantiate_sampling_tokens(float16, F16Key)
instantiate_sampling_tokens(bfloat16, BF16Key)
