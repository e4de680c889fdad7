"""`generate`: continue one prompt (text, a file or token ids), streamed or as JSON, one or
several samples."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from .flags import UsageError, add_decoding_args, add_model_args, check_flags, configs, load_engine
from .output import colour_detokenizer, stats_line, write_tokens


def add_parser(sub) -> None:
    """The `generate` subcommand and its flags."""
    g = sub.add_parser(
        "generate",
        help="generate a continuation of a prompt",
        description=(
            "Generate a continuation of a prompt. Greedy output (--temperature 0) equals the target's "
            "own greedy output token for token in every mode; sampled output follows the target's law."
        ),
        epilog=(
            "Levels: tokens are labelled draft (small model + StreamingLLM cache), retrieval (target "
            "weights over the retrieved KV chunks) or target (the full verifier's own token). "
            "Without --json the text streams to stdout (coloured by level on a terminal) and the "
            "statistics go to stderr."
        ),
    )
    add_model_args(g)
    prompt = g.add_argument_group("prompt (exactly one)")
    src = prompt.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized as is, no chat template)")
    src.add_argument("--prompt-file", help="file with the prompt text (UTF-8)")
    src.add_argument("--prompt-ids-file", help="JSON list of token ids, used as is")
    add_decoding_args(g)
    g.add_argument("--num-samples", type=int, default=1, help="independent samples of the same prompt (one prefill)")
    g.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    g.add_argument("--inspect", action="store_true",
                   help="with --json: each sample adds \"verifications\", every verification with the values its "
                        "rule used for each checked token (q, p, the draw u, the decision, the top of p and q, "
                        "the residual after a rejection; see docs/method.md)")


def cmd_generate(args) -> int:
    from ..decoding.events import Committed, Finished

    if args.num_samples < 1:
        raise UsageError(f"--num-samples must be >= 1, got {args.num_samples}")
    check_flags(args)
    engine, config = load_engine(args)
    prompt = _read_prompt(args, engine)
    if args.inspect and not args.json:
        raise UsageError("--inspect needs --json (the checks are printed in the JSON object)")
    if args.json or args.num_samples > 1:
        results = engine.run_samples(prompt, config, args.num_samples, inspect=args.inspect)
        if args.json:
            out = {
                "samples": [{**_with_token_text(r.as_dict(), engine), "stats": r.stats.as_dict()} for r in results],
                "stats": _summary([r.stats for r in results]),
            }
            print(json.dumps(out))
        else:
            for i, r in enumerate(results):
                print(f"--- sample {i + 1}\n{r.text}")
            print(stats_line(_summary([r.stats for r in results])), file=sys.stderr)
        return 0
    detok = colour_detokenizer(engine, sys.stdout.isatty() and "NO_COLOR" not in os.environ)
    for ev in engine.generate(prompt, config):
        if isinstance(ev, Committed):
            write_tokens(ev, detok)
        elif isinstance(ev, Finished):
            sys.stdout.write("\n")
            print(stats_line(ev.stats.as_dict()), file=sys.stderr)
    return 0


def _read_prompt(args, engine) -> list[int]:
    if args.prompt_ids_file is not None:
        try:
            ids = json.loads(Path(args.prompt_ids_file).read_text())
        except FileNotFoundError:
            raise UsageError(f"prompt ids file not found: {args.prompt_ids_file}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UsageError(f"{args.prompt_ids_file} is not valid JSON: {e}") from None
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise UsageError(f"{args.prompt_ids_file} must hold a JSON list of integers")
        return ids
    if args.prompt_file is not None:
        try:
            text = Path(args.prompt_file).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise UsageError(f"prompt file not found: {args.prompt_file}") from None
        except UnicodeDecodeError:
            raise UsageError(f"prompt file is not UTF-8 text: {args.prompt_file}") from None
    else:
        text = args.prompt
    if engine.tokenizer is None:
        raise UsageError("the target has no tokenizer: use --prompt-ids-file")
    return engine.encode(text)


def _with_token_text(sample: dict, engine) -> dict:
    """Each inspected check gains `text`, its token decoded (when there is a tokenizer)."""
    if engine.tokenizer is not None:
        for v in sample.get("verifications", ()):
            for c in v["checks"]:
                c["text"] = engine.detokenize([c["token_id"]])
    return sample


def _summary(stats: list) -> dict:
    """Figures over all samples (the single sample's own figures when there is one)."""
    if len(stats) == 1:
        return stats[0].as_dict()
    proposed: dict[str, int] = {}
    accepted: dict[str, int] = {}
    for s in stats:
        for k, v in s.proposed.items():
            proposed[k] = proposed.get(k, 0) + v
        for k, v in s.accepted.items():
            accepted[k] = accepted.get(k, 0) + v
    new = sum(s.new_tokens for s in stats)
    decode = sum(s.decode_s for s in stats)
    rounds = sum(s.rounds for s in stats)
    return {
        "samples": len(stats),
        "prompt_tokens": stats[0].prompt_tokens,
        "new_tokens": new,
        "prefill_s": stats[0].prefill_s,
        "decode_s": decode,
        "tokens_per_s": new / decode if decode else 0.0,
        "rounds": rounds,
        "mean_accepted": new / rounds if rounds else 0.0,
        "proposed": proposed,
        "accepted": accepted,
        "acceptance": {k: accepted.get(k, 0) / v if v else 0.0 for k, v in proposed.items()},
        "mode": stats[0].mode,
    }
