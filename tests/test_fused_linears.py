"""FusedLinears: one GEMM for projections of the same input, padded to an aligned width; each Linear keeps its own
parameter (a view), and every batch size (the one-row GEMV path included) gives each Linear's own output."""

import torch
import torch.nn.functional as F

from workers.model import FusedLinears, Linear


def test_fused_linears_equal_their_linears_padded_or_not():
    torch.manual_seed(0)
    for sizes in ((5, 2), (5, 3)):  # 7 rows are padded to 8, 8 are not
        linears = [Linear(16, n, torch.float32, "cpu", bias=True) for n in sizes]
        fused = FusedLinears.of(linears)
        assert fused.weight.shape[0] == 8
        for lin in linears:  # written in place, as a checkpoint load does: the fused weight sees it
            lin.weight.data.normal_()
            lin.bias.data.normal_()
        for rows in (1, 3, 0):
            x = torch.randn(rows, 16)
            outs = fused(x)
            assert len(outs) == len(linears)
            for out, lin in zip(outs, linears):
                assert torch.allclose(out, F.linear(x, lin.weight, lin.bias), atol=1e-6)
        assert torch.count_nonzero(fused.weight[sum(sizes):]) == 0  # padding rows stay zero
