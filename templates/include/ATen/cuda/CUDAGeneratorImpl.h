// Stands in for PyTorch's header of this name when building the mea_sm80 family: CUTLASS example
// 41 applies dropout only with HAS_PYTORCH, and needs from PyTorch nothing but a (seed, offset) pair.
#pragma once
#include "gemmgen/mea_sm80/philox_state.h"
