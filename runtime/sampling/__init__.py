"""Sampling and verification: sampling parameters, the sampler, exact-match and rejection-sampling verification, logprobs, stop criteria, bad words and structured-output grammars."""
