# -*- coding: utf-8 -*-
"""Variable-length decimal addition, generated on the fly (seeded).

One example, both operands with n digits (leading digit non-zero unless n = 1), written least-significant
digit first (operands and answer), as in the reversed-digit format of length-generalization studies:

    <bos> a_0 a_1 ... a_{n-1} + b_0 ... b_{n-1} = c_0 c_1 ... c_m <eos>      (c = a + b, m = n-1 or n)

Batches are right-padded with <pad>; models are causal, so padding after an example cannot change its
logits and no attention mask is passed. The loss and the exact-match metric cover the answer tokens only:
the positions of c_0 ... c_m and <eos> (predicted from the token before each).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100


@dataclass(frozen=True)
class AdditionTokenizer:
    """pad=0, bos=1, eos=2, '+'=3, '='=4, digit d = 5 + d. vocab_size 16 (15 used, rounded up)."""
    pad: int = 0
    bos: int = 1
    eos: int = 2
    plus: int = 3
    eq: int = 4
    digit0: int = 5
    vocab_size: int = 16

    def digits(self, x: int) -> list[int]:
        """Tokens of x, least-significant digit first."""
        return [self.digit0 + int(c) for c in reversed(str(x))]

    def encode(self, a: int, b: int) -> tuple[list[int], int]:
        """(tokens of the full example, index of the first answer token)."""
        if a < 0 or b < 0:
            raise ValueError(f"operands must be non-negative, got a={a}, b={b}")
        prompt = [self.bos] + self.digits(a) + [self.plus] + self.digits(b) + [self.eq]
        return prompt + self.digits(a + b) + [self.eos], len(prompt)

    def decode_number(self, tokens) -> int | None:
        """The number written by digit tokens (least-significant first), read up to <eos>; None if malformed."""
        out = []
        for t in tokens:
            t = int(t)
            if t == self.eos:
                break
            if not self.digit0 <= t < self.digit0 + 10:
                return None
            out.append(str(t - self.digit0))
        return int(''.join(reversed(out))) if out else None

    def decode(self, tokens) -> tuple[int, int, int | None]:
        """(a, b, c) of an encoded example (c None when the answer is malformed)."""
        tokens = [int(t) for t in tokens]
        if tokens[0] != self.bos or self.plus not in tokens or self.eq not in tokens:
            raise ValueError("tokens: not an encoded addition example")
        i, j = tokens.index(self.plus), tokens.index(self.eq)
        return (self.decode_number(tokens[1:i]), self.decode_number(tokens[i + 1:j]),
                self.decode_number(tokens[j + 1:]))


TOKENIZER = AdditionTokenizer()


def sample_operand(n: int, gen: torch.Generator) -> int:
    """A uniformly random n-digit number (0-9 for n = 1)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if n == 1:
        return int(torch.randint(0, 10, (1,), generator=gen))
    digits = torch.randint(0, 10, (n,), generator=gen)
    digits[0] = torch.randint(1, 10, (1,), generator=gen)
    return int(''.join(str(int(d)) for d in digits))


@dataclass
class Batch:
    input_ids: torch.Tensor     # [B, T] long, right-padded
    targets: torch.Tensor       # [B, T] long: targets[:, t] = token at t where t is an answer token, else IGNORE
    lengths: torch.Tensor       # [B] operand digit count n

    def to(self, device) -> 'Batch':
        return Batch(self.input_ids.to(device), self.targets.to(device), self.lengths.to(device))


def make_batch(ns, gen: torch.Generator, tok: AdditionTokenizer = TOKENIZER) -> Batch:
    """One example per entry of `ns` (operand digit counts)."""
    seqs, starts = [], []
    for n in ns:
        s, start = tok.encode(sample_operand(int(n), gen), sample_operand(int(n), gen))
        seqs.append(s)
        starts.append(start)
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), tok.pad, dtype=torch.long)
    tgt = torch.full((len(seqs), T), IGNORE, dtype=torch.long)
    for i, (s, start) in enumerate(zip(seqs, starts)):
        ids[i, :len(s)] = torch.tensor(s)
        tgt[i, start:len(s)] = ids[i, start:len(s)]    # the answer digits and <eos>
    return Batch(ids, tgt, torch.tensor([int(n) for n in ns], dtype=torch.long))


def train_batch(batch_size: int, min_len: int, max_len: int, gen: torch.Generator) -> Batch:
    """Operand lengths uniform in [min_len, max_len]."""
    ns = torch.randint(min_len, max_len + 1, (batch_size,), generator=gen).tolist()
    return make_batch(ns, gen)


def answer_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the answer tokens: the logits at t-1 predict the token at t."""
    return torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets[:, 1:].reshape(-1), ignore_index=IGNORE)


def exact_match(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[B] bool: the teacher-forced argmax equals the target at every answer token.

    Equal to greedy decoding's exact match: if every argmax is right, greedy decoding feeds exactly the
    teacher-forced prefix at each step and writes the same tokens; at the first wrong argmax, greedy
    decoding writes that wrong token. Only the answer (up to and including <eos>) counts.
    """
    pred = logits[:, :-1].argmax(-1)
    tgt = targets[:, 1:]
    mask = tgt != IGNORE
    return ((pred == tgt) | ~mask).all(-1) & mask.any(-1)
