// Instantiations of the greedy verification kernel. Host name:
// verify_greedy_<logits dtype>_<token dtype>, as csrc/metal/verify_greedy.cpp
// builds it.
#include "verify_greedy.h"

#define instantiate_verify_greedy(dname, key, tname, tok)          \
  template [[host_name("verify_greedy_" #dname "_" #tname)]] [[kernel]] \
  decltype(mtplx::verify_greedy<mtplx::key, tok>)                       \
      mtplx::verify_greedy<mtplx::key, tok>;

#define instantiate_verify_greedy_tokens(dname, key)   \
  instantiate_verify_greedy(dname, key, int32, int)    \
  instantiate_verify_greedy(dname, key, int64, long)

instantiate_verify_greedy_tokens(float32, F32Key)
instantiate_verify_greedy_tokens(float16, F16Key)
instantiate_verify_greedy_tokens(bfloat16, BF16Key)
