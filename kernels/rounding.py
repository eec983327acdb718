"""Launch options for the Triton kernels whose roundings follow their PyTorch references op by op (each bf16 op
rounds, as PyTorch's eager ops do).

With fp fusion on (Triton's default), an `extf -> mulf -> truncf` of bf16 operands becomes a bf16 multiply and the
backend contracts it with the add that follows into one `fma.rn.bf16`, which skips the product's rounding: rope's
`x * cos + rotated * sin` came out one bf16 ulp off rope_ref in 22% of the rotated values on the H200. Without
fusion the PTX has `mul.rn.bf16` + `add.rn.bf16` (tests/test_rounding_ptx.py compiles the kernels for sm_90 on CPU
and checks). These kernels are a few us of elementwise work: the fma's saving is nothing there."""

REFERENCE_ROUNDING = {"enable_fp_fusion": False}
