"""From logits to laws, and the two verification rules of speculative decoding.

Names follow the papers: p is the verifier's law (the level whose output must be reproduced
exactly), q the proposer's law, gamma the number of proposed tokens.

Stochastic verification (Leviathan et al. 2023; Chen et al. 2023): proposed token x_i ~ q_i is
accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection a replacement is
drawn from the residual norm(max(0, p_i - q_i)) and the rest is discarded; when all gamma are
accepted a bonus token is drawn from p_gamma. The output then follows p exactly, whatever q is,
provided each x_i was really drawn from q_i.

Greedy verification: accept while x_i == argmax p_i; then emit argmax p at the first mismatch
(or the bonus position). The output then equals greedy decoding of the verifier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import SamplingConfig


def warp(logits: torch.Tensor, cfg: SamplingConfig) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] after temperature, top-k, top-p (in that order).

    The same function produces every level's law, so p and q are warped identically.
    Must not be called for greedy decoding (temperature 0).
    """
    if cfg.greedy:
        raise ValueError("warp() is for sampling; greedy decoding uses argmax")
    x = logits.float() / cfg.temperature
    if cfg.top_k and cfg.top_k < x.shape[-1]:
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p (at least one),
        # as transformers' TopPLogitsWarper: drop tokens whose ascending cumulative mass <= 1 - top_p.
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= 1.0 - cfg.top_p
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x.softmax(dim=-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """Draw one token id from probs [V]."""
    return int(torch.multinomial(probs, 1, generator=generator))


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying gamma proposed tokens.

    accepted   how many proposed tokens were accepted (a prefix)
    token      the verifier's own next token: a residual resample after a rejection, or the
               bonus token when all were accepted
    bonus      True when `token` is the bonus (everything accepted)
    u          stochastic rule: the uniform draws [gamma] it compared (None when greedy)
    residual   stochastic rule after a rejection: the law [V] the replacement was drawn from

    `u` and `residual` are the rule's own tensors, kept so an inspector shows the values that
    decided rather than recomputing them; holding them costs nothing.
    """

    accepted: int
    token: int
    bonus: bool
    u: torch.Tensor | None = None
    residual: torch.Tensor | None = None


def row_argmax(logits: torch.Tensor) -> list[int]:
    """The index of each row's largest value ([R, V] -> R ids; [V] -> one), the first on a tie
    and a NaN counting as largest, as torch.argmax. A CPU tensor goes through NumPy's argmax,
    which gives the same indices and is faster on a CPU: PyTorch spreads one row over its
    threads, on every round of greedy decoding."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and not logits.requires_grad:
        out = logits.numpy().argmax(axis=-1)
    else:
        out = logits.argmax(dim=-1)
    return out.tolist() if logits.dim() > 1 else [int(out)]


def verify_greedy(draft_tokens: list[int], p_logits: torch.Tensor) -> VerifyResult:
    """draft_tokens: gamma ids; p_logits: [gamma + 1, V] verifier logits at each position."""
    target = row_argmax(p_logits)  # [gamma + 1]
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == target[n]:
        n += 1
    return VerifyResult(accepted=n, token=target[n], bonus=n == len(draft_tokens))


def verify_stochastic(
    draft_tokens: list[int],
    q: torch.Tensor | None,
    p: torch.Tensor,
    generator: torch.Generator | None,
) -> VerifyResult:
    """Speculative sampling.

    draft_tokens: gamma ids, each drawn from the matching row of q.
    q: [gamma, V] proposer law, or None for point masses (a proposer with no model, such as
       context lookup: q_i puts all its mass on x_i); p: [gamma + 1, V] verifier law (row
       gamma is the bonus law).

    With a point mass the rule reads: accept x_i with probability p_i(x_i); on rejection draw
    from p_i with x_i removed, renormalised -- which is norm(max(0, p_i - q_i)) for that q_i.
    """
    gamma = len(draft_tokens)
    u = None
    if gamma:
        x = torch.tensor(draft_tokens, device=p.device)
        rows = torch.arange(gamma, device=p.device)
        p_x = p[rows, x]  # [gamma]
        q_x = torch.ones_like(p_x) if q is None else q[rows, x]
        u = torch.rand(gamma, generator=generator, device=p.device)
        # accept iff u < p(x)/q(x); written without the division (q(x) > 0 as x ~ q)
        rejected = (u * q_x >= p_x).nonzero()
        if rejected.numel():
            i = int(rejected[0])
            if q is None:
                residual = p[i].clone()
                residual[draft_tokens[i]] = 0.0
            else:
                residual = (p[i] - q[i]).clamp_min(0.0)
            total = float(residual.sum())
            # p == q up to rounding makes the residual vanish; then p itself is the residual law.
            law = residual / total if total > 0.0 else p[i]
            return VerifyResult(accepted=i, token=sample(law, generator), bonus=False, u=u, residual=law)
    return VerifyResult(accepted=gamma, token=sample(p[gamma], generator), bonus=True, u=u)
