"""vLLM's ``bad_words``: words a request's output must not contain, as token sequences banned where they would end.

A word is tokenized as it is written and, with its leading whitespace stripped, after a space (the form it takes in
the middle of text), the second form kept only where it is a different word of as many tokens (vLLM's rule). A
sequence of one token bans that token everywhere; a longer one bans its last token at every row whose context (the
tokens generated before that row: the request's committed output, then the drafts the step verifies before the row)
ends with the rest of it. Only generated tokens count, as in vLLM: a prompt ending with a word's prefix bans nothing.
The bans are the rows' logits set to -inf (``runtime.worker.logit_constraints.ban_tokens``), so a draft that would complete a word is
rejected like any other and speculation stays exact.
"""

from __future__ import annotations


def token_sequences(tokenizer, words: tuple[str, ...], vocab: int) -> tuple[tuple[int, ...], ...]:
    """``words`` -> the token sequences banned (each word as written, and after a space where that is another word
    of as many tokens). A word the tokenizer makes no tokens of, or tokens outside ``vocab``, is a ``ValueError``
    naming ``SamplingParams.bad_words``."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word, add_special_tokens=False))
        if not plain:
            raise ValueError(f"SamplingParams.bad_words: {word!r} is no token of this model's tokenizer")
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        for ids in (plain, spaced) if spaced and spaced[0] != plain[0] and len(spaced) == len(plain) else (plain,):
            if max(ids) >= vocab:
                raise ValueError(f"SamplingParams.bad_words: {word!r} tokenizes to ids outside this model's "
                                 f"vocabulary (0..{vocab - 1})")
            if ids not in sequences:
                sequences.append(ids)
    return tuple(sequences)


def row_bans(output: list[int], drafts: list[int], sequences: tuple[tuple[int, ...], ...],
             rows: int) -> tuple[tuple[int, ...], ...] | None:
    """The tokens banned at each of a step's ``rows`` rows that commit tokens (row j decides the output token after
    ``output`` and ``drafts[:j]``) -> one sorted tuple a row, or None when no row bans anything."""
    bans, any_ban = [], False
    for j in range(rows):
        banned = set()
        for ids in sequences:
            need = len(ids) - 1  # the tokens before the last, which the context must end with
            if need == 0:
                banned.add(ids[0])
                continue
            if need > len(output) + j:
                continue
            if list(ids[:-1]) == _tail(output, drafts[:j], need):
                banned.add(ids[-1])
        bans.append(tuple(sorted(banned)))
        any_ban = any_ban or bool(banned)
    return tuple(bans) if any_ban else None


def _tail(output: list[int], drafts: list[int], n: int) -> list[int]:
    """The last ``n`` tokens of ``output + drafts`` (without copying the output)."""
    if n <= len(drafts):
        return drafts[len(drafts) - n:]
    return output[len(output) - (n - len(drafts)):] + drafts
