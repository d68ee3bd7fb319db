"""Structured outputs: a request's tokens held to a JSON schema (or any JSON object, a regex, a choice of strings, an
EBNF grammar) by xgrammar's grammar matchers.

The engine keeps one ``GrammarMatcher`` per structured request, on the host, advanced by the tokens the request
commits. Each step it turns the matcher into a token mask per row the request feeds (``row_masks``): row 0 from the
committed tokens, row r from them plus the first r drafts (the matcher accepts each draft in turn, then rolls them
back). The target's logits are masked with those rows before verification (``runtime.worker.runner``), so a draft the grammar
refuses is rejected like any draft the target would not have produced: speculation stays exact, and the drafter, which
does not see the grammar, only loses acceptance. A row past a draft the grammar refused allows every token: that
draft is rejected, so the rows after it are never used.

xgrammar is an optional dependency (``pip install 'dspark[structured]'``): without it a structured request is refused
with an error naming it; nothing else needs it.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import torch

from runtime.sampling.sampling_params import StructuredOutputs

INSTALL = "SamplingParams.structured_outputs needs xgrammar, which is not installed: pip install 'dspark[structured]'"


class GrammarBackend:
    """The engine's grammar compiler over its tokenizer (compiled grammars cached by xgrammar per schema)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int] | None = None):
        """``stop_token_ids``: the engine's end-of-sequence ids (its generation config's, all of them): the tokens
        that complete a grammar (xgrammar alone would take the tokenizer's one EOS)."""
        try:
            import xgrammar
        except ImportError:
            raise ValueError(INSTALL) from None
        self.xgr = xgrammar
        self.info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                            stop_token_ids=stop_token_ids or None)
        self.compiler = xgrammar.GrammarCompiler(self.info)
        self.words = (vocab_size + 31) // 32  # int32 words of a row's mask

    def matcher(self, wanted: StructuredOutputs, compiled=None):
        """A fresh matcher for ``wanted`` (from ``compiled``, its ``compile``, where given: a matcher is cheap, the
        compile is not)."""
        return self.xgr.GrammarMatcher(compiled if compiled is not None else self.compile(wanted))

    def compile(self, wanted: StructuredOutputs):
        """``wanted`` compiled against the tokenizer (xgrammar caches them per source; safe from any thread);
        ``ValueError`` naming the field for a schema, regex or grammar xgrammar refuses (a choice is an EBNF
        alternation of its strings). The JSON is
        laid out as ``json.dumps`` does (", " and ": " between items, no other whitespace): a grammar that allows any
        whitespace lets a model that likes spaces fill ``max_tokens`` with them (vLLM's ``disable_any_whitespace``)."""
        if wanted.regex is not None:
            what, compile_, source = "regex", self.compiler.compile_regex, wanted.regex
        elif wanted.grammar is not None:
            what, compile_, source = "grammar", self.compiler.compile_grammar, wanted.grammar
        elif wanted.choice is not None:  # one of the strings: an EBNF alternation of them as string literals
            what, compile_ = "choice", self.compiler.compile_grammar
            source = "root ::= " + " | ".join(json.dumps(c) for c in wanted.choice)
        else:
            what, compile_ = "json", functools.partial(self.compiler.compile_json_schema, any_whitespace=False)
            source = json.dumps({"type": "object"}) if wanted.json_object else wanted.json
        try:
            return compile_(source)
        except Exception as exc:  # xgrammar's own error types: an unsupported or invalid schema, regex or grammar
            raise ValueError(f"SamplingParams.structured_outputs.{what}: xgrammar cannot compile it: "
                             f"{str(exc)[:500]}") from None

    def row_masks(self, matcher, drafts: list[int]) -> np.ndarray:
        """[1 + len(drafts), words] int32: the tokens the grammar allows at each row of a step that feeds the last
        committed token and ``drafts`` (bit t % 32 of word t // 32). The matcher is left as it was."""
        masks = self.xgr.allocate_token_bitmask(1 + len(drafts), self.info.vocab_size)  # all allowed
        matcher.fill_next_token_bitmask(masks, 0)
        advanced = 0
        for r, draft in enumerate(drafts):
            if matcher.is_terminated() or not matcher.accept_token(draft):
                break  # this draft is rejected: the rows after it are never used
            advanced += 1
            if not matcher.is_terminated():
                matcher.fill_next_token_bitmask(masks, r + 1)
        if advanced:
            matcher.rollback(advanced)
        return masks.numpy()

    @staticmethod
    def accepted(matcher, tokens: list[int]) -> tuple[int, bool]:
        """Advance ``matcher`` over committed ``tokens`` -> (how many it took, whether the grammar is complete after
        them: the last one taken ended it). A token it refuses is a fault of the request (the masks allowed it)."""
        for i, token in enumerate(tokens):
            if not matcher.accept_token(token):
                raise ValueError(f"token {token} was committed where the request's grammar refuses it")
            if matcher.is_terminated():
                return i + 1, True
        return len(tokens), False


def unpack_masks(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, W] int32 masks -> [R, vocab] bool, True where a token is allowed."""
    bits = torch.arange(32, device=words.device, dtype=torch.int32)
    return ((words[:, :, None] >> bits) & 1).bool().view(words.shape[0], -1)[:, :vocab]
