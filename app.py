"""TriForce Studio launcher.

This version runs an interactive chat in the terminal: each answer streams token by token,
coloured by the level that proposed it (green: small draft, blue: retrieval draft, red: full
target), followed by the round's statistics. Everything happens only under `__main__`.

    python app.py                                   # the embedded demo pair
    python app.py --target Qwen/Qwen2.5-7B-Instruct --draft Qwen/Qwen2.5-0.5B-Instruct
"""

from __future__ import annotations

import argparse
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="TriForce Studio: chat with a model, see speculative decoding work.")
    p.add_argument("--target", help="hub id or local folder (default: the embedded demo target)")
    p.add_argument("--draft", help="small draft sharing the target's vocabulary (default: the demo draft)")
    p.add_argument("--device", default="auto", help="auto|cpu|cuda")
    p.add_argument("--dtype", default="auto", help="auto|float32|bfloat16|float16")
    p.add_argument("--mode", choices=["triforce", "retrieval", "draft", "autoregressive"])
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--budget", type=int, default=4096, help="retrieval budget in tokens")
    p.add_argument("--system", default=None, help="system prompt (models with a chat template)")
    return p.parse_args(argv)


def _prompt_ids(engine, history: list[dict]) -> list[int]:
    tok = engine.tokenizer
    if getattr(tok, "chat_template", None):
        return list(tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True, return_dict=False))
    text = "\n".join(f"{m['role']}: {m['content']}" for m in history) + "\nassistant:"
    return engine.encode(text)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from triforce_core import (
        CacheConfig,
        ConfigError,
        ContextLengthError,
        GenerationConfig,
        ModelLoadError,
        SamplingConfig,
        SpeculationConfig,
        TriForceEngine,
    )
    from triforce_core.events import Committed, Finished
    from triforce_core.loading import default_model_names
    from ui import TokenSplitter, ansi

    try:
        target, draft = default_model_names(args.target, args.draft)
        print(f"loading {target}" + (f" with draft {draft}" if draft else "") + " ...", file=sys.stderr)
        engine = TriForceEngine.from_pretrained(target, draft, device=args.device, dtype=args.dtype)
        if engine.tokenizer is None:
            raise ModelLoadError(f"{target} has no tokenizer; the chat needs one")
        mode = args.mode or ("triforce" if engine.draft is not None else "retrieval")
        config = GenerationConfig(
            sampling=SamplingConfig(temperature=args.temperature, top_p=args.top_p),
            speculation=SpeculationConfig(mode=mode, max_new_tokens=args.max_new_tokens),
            cache=CacheConfig(budget=args.budget),
        )
    except (ModelLoadError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print("Type a message (an empty line or Ctrl-D quits). Green: small draft, blue: retrieval, red: target.")
    while True:
        try:
            message = input("> ").strip()
        except EOFError:
            return 0
        if not message:
            return 0
        history.append({"role": "user", "content": message})
        events = []
        splitter = TokenSplitter(engine.decode)
        try:
            for ev in engine.generate(_prompt_ids(engine, history), config):
                if isinstance(ev, Committed):
                    events.append(ev)
                    sys.stdout.write(ansi(splitter.push(ev)))
                    sys.stdout.flush()
                elif isinstance(ev, Finished):
                    s = ev.stats
                    acc = ", ".join(f"{k} {v:.2f}" for k, v in s.acceptance.items()) or "n/a"
                    print(f"\n[{s.mode}: {s.new_tokens} tokens, {s.tokens_per_s:.1f} tok/s, acceptance {acc}]")
        except ContextLengthError as e:
            print(f"error: {e}", file=sys.stderr)
            history.pop()
            continue
        except KeyboardInterrupt:
            print("\n[stopped]")
        answer = "".join(ev.text for ev in events)
        history.append({"role": "assistant", "content": answer})


if __name__ == "__main__":
    sys.exit(main())
