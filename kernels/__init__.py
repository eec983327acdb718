"""hybridspec kernels: Triton kernels and, beside each, a PyTorch reference with the same signature.

Nothing here imports the rest of the project. Ragged batches are described by `cu_seqlens` [B+1] (int32):
request i owns rows cu_seqlens[i]:cu_seqlens[i+1] of every flat [N, ...] token tensor.
"""
