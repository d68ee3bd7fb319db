"""The greedy Markov-head step in one Triton kernel (``triton_ops.markov_argmax``) under Triton's CPU interpreter:
against ``torch_ref.markov_argmax`` for ragged vocabularies and ranks, strided rows, more than one block of
requests; the first index on ties; a row of NaN still gives a valid token id."""

from tests.runtime.interpreter import run_interpreted

CHECK = """
import torch
from runtime.kernels import torch_ref, triton_ops
torch.manual_seed(0)
for dtype in (torch.float32, torch.float16):
    for num, vocab, rank in ((1, 700, 16), (5, 513, 48), (17, 300, 100), (3, 256, 256)):
        base = torch.randn(num, 3, vocab)[:, 1]  # rows strided as a block's k-th position is
        low_rank = torch.randn(num, rank).to(dtype)
        weight = (torch.randn(vocab, rank) / rank ** 0.5).to(dtype)
        got = triton_ops.markov_argmax(base, low_rank, weight)
        want = torch_ref.markov_argmax(base, low_rank, weight)
        assert got.dtype == torch.int64 and got.shape == (num,)
        assert torch.equal(got, want), (dtype, num, vocab, rank, got, want)
base = torch.zeros(2, 600)
base[0, 37] = base[0, 450] = 5.0  # a tie across tiles: the first index
base[1] = float("nan")
got = triton_ops.markov_argmax(base, torch.zeros(2, 16), torch.zeros(600, 16))
assert got[0].item() == 37 and 0 <= got[1].item() < 600, got
print("markov ok")
"""


def test_the_markov_step_kernel_under_the_interpreter():
    run_interpreted(CHECK, "markov ok")


def test_the_torch_reference_is_the_markov_heads_own_step():
    """The reference is what the draft runner computed before the kernel: z + markov_w2(low_rank) in the model's
    dtype, then the argmax."""
    import torch

    from runtime.kernels import torch_ref

    torch.manual_seed(1)
    linear = torch.nn.Linear(8, 50, bias=False)
    base, low_rank = torch.randn(4, 50), torch.randn(4, 8)
    with torch.no_grad():
        assert torch.equal(torch_ref.markov_argmax(base, low_rank, linear.weight),
                           (base + linear(low_rank).float()).argmax(dim=-1))
