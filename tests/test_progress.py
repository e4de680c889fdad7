"""The prefill's arithmetic and the time left the progress line promises."""

from __future__ import annotations

from dataclasses import replace

from tests.helpers.models import make_hf, to_ours
from triforce_core.decoding.events import PrefillProgress
from triforce_core.models.roofline import nonembedding_params, prefill_flops
from ui.views import prefill_progress_text


def test_nonembedding_params_count_the_checkpoints_projections():
    hf = make_hf("llama_gqa_llama3")
    spec = to_ours(hf).spec
    projections = sum(p.numel() for n, p in hf.named_parameters() if n.endswith("proj.weight"))
    assert nonembedding_params(spec) == projections


def test_prefill_flops_count_every_causal_pair():
    spec = to_ours(make_hf("llama_gqa_llama3")).spec
    per_pair = 4 * spec.head_dim * spec.num_heads * spec.num_layers
    per_token = 2 * nonembedding_params(spec)
    for start, end in ((0, 1), (0, 10), (7, 19)):
        pairs = sum(p + 1 for p in range(start, end))  # position p attends to p + 1 keys
        assert prefill_flops(spec, start, end) == per_token * (end - start) + per_pair * pairs
    assert prefill_flops(spec, 0, 19) == prefill_flops(spec, 0, 7) + prefill_flops(spec, 7, 19)


def test_time_left_follows_the_arithmetic_not_the_token_rate():
    spec = replace(to_ours(make_hf("llama_gqa_llama3")).spec, hidden_size=0, intermediate_size=0)  # attention only
    # Half the tokens from position 0 are a quarter of the pairs: three times the time so far is left.
    line = prefill_progress_text(PrefillProgress(5000, 10000, 0), 10.0, spec)
    assert line == "prefilling 5,000 / 10,000 tokens · 500 tokens/s · about 30 s left"
    # After 20,000 reused tokens the second half costs (30k^2 - 25k^2) / (25k^2 - 20k^2) = 11/9 the first.
    line = prefill_progress_text(PrefillProgress(5000, 10000, 20000), 90.0, spec)
    assert line.endswith("about 2 min left")  # 110 s
    assert prefill_progress_text(PrefillProgress(0, 10000, 0), 0.0, spec) == "prefilling 0 / 10,000 tokens"
