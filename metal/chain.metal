// Instantiations of the chain kernels. Host names:
// verify_greedy_chain[_biased]_<logits dtype>_<token dtype> and
// verify_sampled_chain[_biased]_<logits dtype>_<token dtype>, as csrc/metal/verify_greedy.cpp and csrc/metal/sampling.cpp
// builds them.
#include "chain.h"

#define instantiate_chain(dname, key, tname, tok)                             \
  template [[host_name("verify_greedy_chain_" #dname "_" #tname)]] [[kernel]]  \
  decltype(mtplx::verify_greedy_chain<mtplx::key, tok>)                        \
      mtplx::verify_greedy_chain<mtplx::key, tok>;                             \
  template [[host_name("verify_sampled_chain_" #dname "_" #tname)]] [[kernel]] \
  decltype(mtplx::verify_sampled_chain<mtplx::key, tok>)                       \
      mtplx::verify_sampled_chain<mtplx::key, tok>;                            \
  template [[host_name("verify_greedy_chain_biased_" #dname "_" #tname)]]      \
  [[kernel]] decltype(mtplx::verify_greedy_chain_biased<mtplx::key, tok>)      \
      mtplx::verify_greedy_chain_biased<mtplx::key, tok>;                      \
  template [[host_name("verify_sampled_chain_biased_" #dname "_" #tname)]]     \
  [[kernel]] decltype(mtplx::verify_sampled_chain_biased<mtplx::key, tok>)     \
      mtplx::verify_sampled_chain_biased<mtplx::key, tok>;

#define instantiate_chain_tokens(dname, key) \
  instantiate_chain(dname, key, int32, int)  \
  instantiate_chain(dname, key, int64, long)

instantiate_chain_tokens(float32, F32Key)
instantiate_chain_tokens(float16, F16Key)
instantiate_chain_tokens(bfloat16, BF16Key)
