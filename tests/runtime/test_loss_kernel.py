"""The drafter loss's Triton kernels (``runtime.kernels.triton_loss``, what ``cross_entropy_and_l1`` runs on a GPU)
under Triton's CPU interpreter: the cross-entropy, the L1 between the softmaxes and the gradient equal the torch
path's and autograd's, over rows longer than a tile (the last tile ragged), for every pair of loss weights (a weight
of 0 leaves its output without a gradient), a bfloat16 target read as float32, and rows where the two softmaxes are
equal (the L1's gradient there is autograd's 0)."""

import pytest

from tests.runtime.interpreter import run_interpreted

CHECK = """
import torch
import torch.nn.functional as F
from runtime.kernels import triton_loss
from runtime.training import loss
triton_loss.BLOCK_V = 256  # rows of 1,000: four tiles, the last ragged
torch.manual_seed(0)
rows, vocab = 9, 1000
for target_dtype in (torch.float32, torch.bfloat16):
    draft = 3 * torch.randn(rows, vocab)
    target = (3 * torch.randn(rows, vocab)).to(target_dtype)
    target[0] = draft[0].to(target_dtype)  # equal softmaxes where the dtype keeps them so
    labels = torch.randint(0, vocab, (rows,))
    weights = torch.rand(rows)
    for ce_weight, l1_weight in ((0.1, 0.9), (1.0, 0.0), (0.0, 1.0)):
        fused = draft.clone().requires_grad_(True)
        ce, l1 = loss._FusedCrossEntropyAndL1.apply(fused, target, labels)
        reference = draft.clone().requires_grad_(True)
        want_ce = F.cross_entropy(reference, labels, reduction="none")
        want_l1 = (reference.softmax(-1) - target.float().softmax(-1)).abs().sum(-1)
        torch.testing.assert_close(ce, want_ce)
        torch.testing.assert_close(l1, want_l1)
        terms = [w * x for w, x in ((ce_weight, ce), (l1_weight, l1)) if w]
        (got,) = torch.autograd.grad((sum(terms) * weights).sum(), fused)
        want_terms = [w * x for w, x in ((ce_weight, want_ce), (l1_weight, want_l1)) if w]
        (want,) = torch.autograd.grad((sum(want_terms) * weights).sum(), reference)
        torch.testing.assert_close(got, want)
        chunked = draft.clone().requires_grad_(True)
        c_ce, c_l1 = loss._CrossEntropyAndL1.apply(chunked, target.float(), labels, 4)
        (c_got,) = torch.autograd.grad(((ce_weight * c_ce + l1_weight * c_l1) * weights).sum(), chunked)
        torch.testing.assert_close(got, c_got)
print("loss kernels ok")
"""


def test_the_loss_kernels_are_the_torch_paths_under_the_interpreter():
    run_interpreted(CHECK, "loss kernels ok")


def test_the_gpu_tests_gradient_tolerance_allows_a_ties_sign_and_nothing_more():
    """``tests/gpu/tolerances.assert_close_but_for_ties``: where a draft and a target probability agree to rounding,
    the L1's gradient may take either sign there (two paths that round differently do); the tolerance allows a row
    exactly what such a flip moves it by, and holds a row without a tie to the plain tolerance."""
    import torch

    from tests.gpu.tolerances import assert_close_but_for_ties

    torch.manual_seed(0)
    rows, vocab, l1_weight = 8, 512, 0.9
    draft, target, weights = 3 * torch.randn(rows, vocab), 3 * torch.randn(rows, vocab), torch.rand(rows) + 0.5
    draft[:, 7] = 16.0  # a probable entry: its flip moves the whole row
    p = draft.double().softmax(-1)
    # row 0's target makes entry 7 a tie: q_7 = p_7 up to rounding, the other entries as they were
    rest = target[0].double().exp().sum() - target[0, 7].double().exp()
    target[0, 7] = float(torch.log(p[0, 7] * rest / (1 - p[0, 7])))
    q = target.double().softmax(-1)
    assert (p[0, 7] - q[0, 7]).abs() < 1e-6 * p[0, 7] and p[0, 7] > 0.5
    sign = torch.sign(p - q)
    sign[0, 7] = 1  # one path's rounding; the other's below

    def l1_gradient(signs):  # [R, V]: d/d draft of l1_weight * w_r * sum |p - q|, p (s - <s, p>)
        return (l1_weight * weights.double()[:, None] * p * (signs - (signs * p).sum(-1, keepdim=True))).float()

    want = l1_gradient(sign)
    flipped = sign.clone()
    flipped[0, 7] = -1
    assert (l1_gradient(flipped) - want).abs().max() > 1e-3  # a flip is far outside the plain tolerance
    assert_close_but_for_ties(l1_gradient(flipped), want, draft, target, weights, l1_weight)
    elsewhere = want.clone()
    elsewhere[1] += l1_gradient(flipped)[0] - want[0]  # the same move in a row without a tie
    with pytest.raises(AssertionError, match="gradient entries off"):
        assert_close_but_for_ties(elsewhere, want, draft, target, weights, l1_weight)
