"""The numbers behind each verification decision, for the teaching inspector (opt-in).

With `inspect=True` a generation reports, for every proposed token a verifier checked, the
values its rule used (`events.TokenCheck`): q(x), p(x), the uniform draw u, the decision, the
top entries of p and q at that position and, after a rejection, of the residual law the
replacement was drawn from. They are read off the tensors the rule itself used
(`sampling.VerifyResult.u` and `.residual`), never recomputed.
"""

from __future__ import annotations

import torch

from .events import TokenCheck, TopEntries

TOP_K = 10  # entries of p, q and the residual shown per position


def top_entries(law: torch.Tensor, k: int = TOP_K) -> TopEntries:
    """The `k` most likely (token id, probability) pairs of `law` [V] with probability > 0."""
    values, ids = torch.topk(law.float(), min(k, law.shape[-1]))
    return tuple((int(i), float(v)) for i, v in zip(ids.tolist(), values.tolist()) if v > 0.0)


def greedy_law(logits: torch.Tensor) -> torch.Tensor:
    """What greedy decoding shows as a level's law: the softmax of its logits at temperature 1."""
    return logits.float().softmax(dim=-1)


def token_checks(verifier: str, tokens: list[int], levels: list[str], q: torch.Tensor | None,
                 p: torch.Tensor, result) -> tuple[TokenCheck, ...]:
    """One `TokenCheck` per checked token: the accepted prefix and the first rejected one.

    tokens/levels: the proposed ids and who proposed each; q: [gamma, V] the law each was
    drawn from (None: point masses); p: [gamma + 1, V] the verifier's law; result: the
    `VerifyResult` of the rule.
    """
    checked = min(len(tokens), result.accepted + (0 if result.bonus else 1))
    u = result.u.tolist() if result.u is not None else None
    out = []
    for i in range(checked):
        x = tokens[i]
        rejected = i == result.accepted
        out.append(TokenCheck(
            token_id=x,
            proposer=levels[i],
            verifier=verifier,
            q=1.0 if q is None else float(q[i, x]),
            p=float(p[i, x]),
            u=None if u is None else float(u[i]),
            accepted=not rejected,
            p_top=top_entries(p[i]),
            q_top=((x, 1.0),) if q is None else top_entries(q[i]),
            residual_top=top_entries(result.residual) if rejected and result.residual is not None else (),
        ))
    return tuple(out)
