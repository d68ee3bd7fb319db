"""The drafter loss on a GPU (``runtime.training.loss.cross_entropy_and_l1``, whose CUDA path is the Triton kernels of
``runtime.kernels.triton_loss``) against the torch path on the same GPU, at SmolLM2's vocabulary with a bfloat16
target as the recipe trains: values and gradients. Skipped without a GPU and triton."""

import pytest
import torch

from tests.gpu.tolerances import assert_close_but_for_ties

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

DEV = torch.device("cuda")


@pytest.mark.parametrize("ce_weight,l1_weight", [(0.1, 0.9), (1.0, 0.0)])
def test_the_fused_loss_is_the_torch_paths_on_a_gpu(ce_weight, l1_weight):
    from runtime.training import loss

    torch.manual_seed(0)
    rows, vocab = 3000, 49152
    draft = 4 * torch.randn(rows, vocab, device=DEV)
    target = (4 * torch.randn(rows, vocab, device=DEV)).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (rows,), device=DEV)
    weights = torch.rand(rows, device=DEV)
    fused = draft.clone().requires_grad_(True)
    ce, l1 = loss.cross_entropy_and_l1(fused, target, labels)
    reference = draft.clone().requires_grad_(True)
    want_ce, want_l1 = loss._CrossEntropyAndL1.apply(reference, target.float(), labels, 512)
    torch.testing.assert_close(ce, want_ce, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(l1, want_l1, rtol=1e-5, atol=1e-5)
    terms = [w * x for w, x in ((ce_weight, ce), (l1_weight, l1)) if w]
    (got,) = torch.autograd.grad((sum(terms) * weights).sum(), fused)
    (want,) = torch.autograd.grad(((ce_weight * want_ce + l1_weight * want_l1) * weights).sum(), reference)
    assert_close_but_for_ties(got, want, draft, target, weights, l1_weight)

