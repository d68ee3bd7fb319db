"""Tolerances of the GPU tests that compare two computations of one value."""

import torch


def assert_close_but_for_ties(got, want, draft, target, weights, l1_weight, rtol=1e-4, atol=1e-7):
    """``got`` within rtol / atol of ``want``, but for the L1's ties: its gradient ``p (s - <s, p>)`` takes the sign
    ``s = sign(p - q)`` of each softmax difference, and where p and q agree to rounding (a tie) two paths that round
    differently may take either sign. A flip at k moves row r's gradient by ``2 p_k (onehot_k - p)`` (times the loss
    weights), so each row is allowed ``2 w_r l1_weight T_r (p + tied)``, T_r the probability its tied entries hold:
    nothing where a row has no tie, which most rows have not."""
    p, q = torch.softmax(draft.double(), -1), torch.softmax(target.double(), -1)  # [R, V]
    tied = (p - q).abs() <= 1e-5 * torch.maximum(p, q)
    tied_mass = (p * tied).sum(-1, keepdim=True)  # [R, 1]
    allowance = 2 * l1_weight * weights.double()[:, None] * tied_mass * (p + tied)
    excess = (got.double() - want.double()).abs() - (rtol * want.double().abs() + atol) - allowance
    worst = int(excess.flatten().argmax())
    assert excess.max() <= 0, (f"{int((excess > 0).sum())} gradient entries off; worst at {divmod(worst, p.shape[1])}: "
                               f"{float(got.flatten()[worst]):.3e} against {float(want.flatten()[worst]):.3e}")
    assert tied.any(-1).double().mean() < 0.2  # the plain tolerance holds most rows
