// The CUDA toolkit's curand_kernel.h where it is installed; otherwise the Philox4x32-10 subset the
// memory-efficient attention kernel (CUTLASS example 41) includes it for (dropout), so that
// toolkits without cuRAND still build the mea_sm80 family.
#pragma once
#if __has_include_next(<curand_kernel.h>)
#include_next <curand_kernel.h>
#else
#include "gemmgen/mea_sm80/philox.h"
#endif
