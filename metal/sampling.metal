// Instantiations of the sampling kernels. Host names:
// sample_tokens[_biased]_<logits dtype>_<token dtype> (sample_tokens once
// without and once with the logit bias, kBiased) and
// verify_sampled_<logits dtype>_<token dtype>, as csrc/metal/sampling.cpp
// builds them.
#include "sampling.h"

#define instantiate_sampling(dname, key, tname, tok)                       \
  template [[host_name("sample_tokens_" #dname "_" #tname)]] [[kernel]]      \
  decltype(mtplx::sample_tokens<mtplx::key, tok, false>)                     \
      mtplx::sample_tokens<mtplx::key, tok, false>;                          \
  template [[host_name("sample_tokens_biased_" #dname "_" #tname)]]          \
  [[kernel]] decltype(mtplx::sample_tokens<mtplx::key, tok, true>)           \
      mtplx::sample_tokens<mtplx::key, tok, true>;                           \
  template [[host_name("verify_sampled_" #dname "_" #tname)]] [[kernel]]     \
  decltype(mtplx::verify_sampled<mtplx::key, tok>)                           \
      mtplx::verify_sampled<mtplx::key, tok>;

#define instantiate_sampling_tokens(dname, key) \
  instantiate_sampling(dname, key, int32, int)  \
  instantiate_sampling(dname, key, int64, long)

instantiate_sampling_tokens(float32, F32Key)
instantiate_sampling_tokens(float16, F16Key)
instantiate_sampling_tokens(bfloat16, BF16Key)
