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
    """One example per entry of `ns` (operand digit counts), built with batched tensor ops (a GPU step of the
    paper preset's models takes a few ms; one Python loop per example took ~7 ms a batch of 128 on the CPU).
    Same format and distribution as encoding `sample_operand` pairs one by one."""
    n = torch.as_tensor(ns, dtype=torch.long).reshape(-1)
    if n.numel() and int(n.min()) < 1:
        raise ValueError(f"operand lengths must be >= 1, got {int(n.min())}")
    Bn = n.numel()
    L = int(n.max()) if Bn else 1
    pos = torch.arange(L)
    inside = pos[None, :] < n[:, None]
    top = (pos[None, :] == (n - 1)[:, None]) & (n[:, None] > 1)   # the leading digit of a multi-digit operand
    # digits least-significant first: uniform 0-9, the leading one 1-9, zero beyond the operand
    a = torch.randint(0, 10, (Bn, L), generator=gen)
    a = torch.where(top, torch.randint(1, 10, (Bn, L), generator=gen), a) * inside
    b = torch.randint(0, 10, (Bn, L), generator=gen)
    b = torch.where(top, torch.randint(1, 10, (Bn, L), generator=gen), b) * inside
    # c = a + b digit by digit with the carry, one more digit for the last carry
    c = torch.zeros(Bn, L + 1, dtype=torch.long)
    carry = torch.zeros(Bn, dtype=torch.long)
    for i in range(L):
        s = a[:, i] + b[:, i] + carry
        c[:, i], carry = s % 10, s // 10
    c[:, L] = carry
    m = n + (c.gather(1, n[:, None]).squeeze(1) > 0).long()          # answer digits: n, or n + 1 with a carry out
    # layout: <bos> a (n) + b (n) = c (m) <eos>, then <pad>
    T = int((2 * n + m + 4).max()) if Bn else 1
    t = torch.arange(T)[None, :]
    n_, m_ = n[:, None], m[:, None]
    ids = torch.full((Bn, T), tok.pad, dtype=torch.long)
    ids = torch.where(t == 0, tok.bos, ids)
    ia = (t - 1).clamp(0, L - 1)
    ids = torch.where((t >= 1) & (t <= n_), tok.digit0 + a.gather(1, ia.expand(Bn, T)), ids)
    ids = torch.where(t == n_ + 1, tok.plus, ids)
    ib = (t - n_ - 2).clamp(0, L - 1)
    ids = torch.where((t >= n_ + 2) & (t <= 2 * n_ + 1), tok.digit0 + b.gather(1, ib), ids)
    ids = torch.where(t == 2 * n_ + 2, tok.eq, ids)
    ic = (t - 2 * n_ - 3).clamp(0, L)
    ids = torch.where((t >= 2 * n_ + 3) & (t < 2 * n_ + 3 + m_), tok.digit0 + c.gather(1, ic), ids)
    ids = torch.where(t == 2 * n_ + 3 + m_, tok.eos, ids)
    answer = (t >= 2 * n_ + 3) & (t <= 2 * n_ + 3 + m_)                # the answer digits and <eos>
    tgt = torch.where(answer, ids, torch.full_like(ids, IGNORE))
    return Batch(ids, tgt, n.clone())


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
