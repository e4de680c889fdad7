"""Command-line flags shared by `python app.py` and the `generate`, `chat` and `serve` commands."""

from __future__ import annotations

import argparse

from ..config import DEFAULT_KV_DTYPE, GB, KV_CACHE_MAX_GB, KV_DTYPES, default_kv_cache_folder


def add_kv_dtype_arg(parser) -> None:
    """--kv-dtype (a parser or an argument group)."""
    parser.add_argument(
        "--kv-dtype", choices=[*KV_DTYPES, "auto"], default=None,
        help=f"what the caches keep keys and values in (default auto: {DEFAULT_KV_DTYPE} for a float32 model on "
        "the CPU, where greedy output equals Hugging Face's; else the model's dtype). float16 is much faster on the "
        "CPU (about 0.6x float32's step at 16K-64K) and changes an answer now and then; greedy output equals "
        "autoregressive decoding with the same K/V dtype")


def add_kv_cache_args(parser) -> None:
    """--kv-cache-dir, --no-kv-cache, --kv-cache-max-gb (a parser or an argument group)."""
    g = parser.add_argument_group("prefill kept on disk") if isinstance(parser, argparse.ArgumentParser) else parser
    g.add_argument("--kv-cache-dir", metavar="DIR", default=None,
                   help="keep documents' prefilled K/V here and read them back when the same text is opened "
                   f"again, after a restart too (default: {default_kv_cache_folder()}; $XDG_CACHE_HOME/triforce-studio/kv, "
                   "else ~/.cache/triforce-studio/kv)")
    g.add_argument("--no-kv-cache", action="store_true", help="neither read nor write prefilled K/V on disk")
    g.add_argument("--kv-cache-max-gb", type=float, default=KV_CACHE_MAX_GB, metavar="GB",
                   help="size cap of that folder; least recently used blocks are deleted (default %(default)g)")


def check_kv_cache_args(args) -> None:
    """Raise ValueError for bad values (before any model is loaded)."""
    if not args.kv_cache_max_gb > 0:
        raise ValueError(f"--kv-cache-max-gb must be > 0, got {args.kv_cache_max_gb}")
    if args.no_kv_cache and args.kv_cache_dir is not None:
        raise ValueError("--kv-cache-dir and --no-kv-cache contradict each other")


def apply_kv_cache_args(engine, args) -> None:
    """Give `engine` the disk cache the flags ask for (none with --no-kv-cache)."""
    check_kv_cache_args(args)
    if not args.no_kv_cache:
        engine.use_disk_cache(args.kv_cache_dir, int(args.kv_cache_max_gb * GB))


def add_models_dir_arg(parser) -> None:
    """--models-dir DIR, repeatable (the app and `serve`)."""
    parser.add_argument(
        "--models-dir", metavar="DIR", action="append", default=[],
        help="a folder of GGUF files to offer besides the started model (repeatable); the app's model picker and "
        "GET /v1/models also list those found where LM Studio, Ollama and the Hugging Face cache keep models. The "
        "browser may open files under these folders only")


def served_models(args, target: str, draft: str | None, slots: int):
    """The models a server offers (`serving.models.ServedModels`), each loaded with the flags'
    device, dtype, K/V dtype and disk cache. Raises ValueError for a --models-dir that is no folder."""
    from ..engine import TriForceEngine
    from ..models.folders import ModelFolders
    from ..serving.registry import ServedModels

    def load(choice):
        engine = TriForceEngine.from_pretrained(choice.target, choice.draft, device=args.device, dtype=args.dtype,
                                                kv_dtype=args.kv_dtype)
        apply_kv_cache_args(engine, args)
        return engine

    return ServedModels(load, ModelFolders.default(args.models_dir), started=(target, draft), slots=slots)
