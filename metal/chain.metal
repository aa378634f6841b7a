// Instantiations of the chain kernels, each once without and once with the
// logit bias (kBiased). Host names:
// verify_greedy_chain[_biased]_<logits dtype>_<token dtype> and
// verify_sampled_chain[_biased]_<logits dtype>_<token dtype>, as
// csrc/metal/verify_greedy.cpp and csrc/metal/sampling.cpp build them.
#include "chain.h"

#define instantiate_chain_kernel(fn, suffix, dname, key, tname, tok, biased) \
  template [[host_name(#fn suffix "_" #dname "_" #tname)]] [[kernel]]        \
  decltype(mtplx::fn<mtplx::key, tok, biased>)                               \
      mtplx::fn<mtplx::key, tok, biased>;

#define instantiate_chain(dname, key, tname, tok)                            \
  instantiate_chain_kernel(                                                  \
      verify_greedy_chain, "", dname, key, tname, tok, false)                \
  instantiate_chain_kernel(                                                  \
      verify_greedy_chain, "_biased", dname, key, tname, tok, true)          \
  instantiate_chain_kernel(                                                  \
      verify_sampled_chain, "", dname, key, tname, tok, false)               \
  instantiate_chain_kernel(                                                  \
      verify_sampled_chain, "_biased", dname, key, tname, tok, true)

#define instantiate_chain_tokens(dname, key) \
  instantiate_chain(dname, key, int32, int)  \
  instantiate_chain(dname, key, int64, long)

instantiate_chain_tokens(float32, F32Key)
instantiate_chain_tokens(float16, F16Key)
instantiate_chain_tokens(bfloat16, BF16Key)
