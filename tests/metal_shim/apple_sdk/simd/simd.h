// Stand-in for <simd/simd.h>: the vector types metal-cpp names.
#pragma once
