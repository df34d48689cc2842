"""The operations users call (fused attention, batched GEMM, the unfused baseline), their torch
custom ops, and the float64 attention reference."""
