// Stands in for PyTorch's header of this name when building the mea_sm80 family (see
// CUDAGeneratorImpl.h beside it); everything it is needed for is declared there.
#pragma once
#include "gemmgen/mea_sm80/philox_state.h"
