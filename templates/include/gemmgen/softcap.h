// The logit softcap's tanh (scores s become c * tanh(s / c) before the softmax), one definition
// for every family that caps scores, forward and backward: a backward recomputes P = exp(capped -
// LSE) from the LSE of a forward that may have run in another family, so both must cap with the
// same function.
//
// tanh.approx.f32 is one MUFU operation (sm_75 and later), where 1 - 2 / (e^2x + 1) takes two (an
// exponential and a reciprocal): the Hopper forward's softmax at head dim 128 also spends one on
// each score's exponential, and with this tanh its capped call runs at 0.78-0.84x the uncapped one,
// with the two-operation form at 0.51-0.61x (bench/NOTES.md 100). Its relative error is at most
// 2^-10.987 (PTX ISA), about fp16's rounding of the capped score; docs/design.md states the
// accuracy this gives the outputs.
#pragma once

namespace gemmgen {

__device__ __forceinline__ float softcap_tanh(float x) {
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(x));
  return t;
}

}  // namespace gemmgen
