"""`chat`: questions about a document as one conversation, the document prefilled once; a
document beyond the window is read by the sections most relevant to each question."""

from __future__ import annotations

import json
import os
import sys

from ..config import CHAT_MAX_NEW_TOKENS
from ..prompting import PLAIN_LAYOUT_NOTE, has_chat_template
from ..documents.picking import SectionError, parse_spec, section_tokens, selected_text, too_long_message
from .flags import (UsageError, add_decoding_args, add_kv_cache_args, add_model_args, apply_kv_cache_args, check_flags,
                    load_engine)
from .output import colour_detokenizer, stats_line, write_tokens


def add_parser(sub) -> None:
    """The `chat` subcommand and its flags."""
    c = sub.add_parser(
        "chat",
        help="answer questions about a document, as one conversation",
        description=(
            "Answer questions about a document as one conversation, with the target's chat template. "
            "The document is prefilled once; each later question prefills only its own tokens "
            "(and the previous answer's), reusing the cached document."
        ),
        epilog=(
            "A conversation longer than the target's context window is refused with the numbers, "
            "unless --truncate is given (then the document's end is cut and the cut is reported). "
            "A document beyond the window is read, for each question, by the sections most relevant to it "
            "(--sections auto; each turn's sections_read on stderr, or in --json). A --sections all or "
            "3,5-7 selection that does not fit is refused before any prefill, with its size, the window "
            "and the sizes of its top-level sections to pick from."
        ),
    )
    add_model_args(c)
    conv = c.add_argument_group("conversation")
    conv.add_argument("--document", metavar="FILE", help="txt, md, html, pdf, epub or docx (optional)")
    conv.add_argument("--question", action="append", required=True, metavar="Q",
                      help="a question; repeat for several turns, asked in order")
    conv.add_argument("--system", help="system prompt")
    conv.add_argument("--truncate", action="store_true",
                      help="cut the document's end when the conversation would not fit (reported)")
    conv.add_argument("--sections", metavar="LIST",
                      help="which sections of the document to read: auto (each question reads the sections most "
                      "relevant to it, ranked by BM25, whole, up to --reading-budget tokens; the default for a "
                      "document beyond the window), all (the whole document; refused with the numbers when it does "
                      "not fit), or numbers such as 3,5-7 (numbered from 1 as `ingest --json` lists them; a section "
                      "includes its subsections)")
    conv.add_argument("--reading-budget", type=int, default=None, metavar="TOKENS",
                      help="with --sections auto: tokens of the book each question reads at most (default 4096, "
                      "measured with the demo pair; never more than the window leaves)")
    conv.add_argument("--max-mb", type=float, default=50.0, help="largest document accepted, in MB (default 50)")
    add_decoding_args(c, max_new=CHAT_MAX_NEW_TOKENS)  # a chat answer's limit
    add_kv_cache_args(c)
    c.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def cmd_chat(args) -> int:
    from ..documents import DocumentError, load_document
    from ..decoding.events import Committed, Finished, Prefilled
    from ..serving.book import BookSession

    check_flags(args)
    if any(not (q or "").strip() for q in args.question):
        raise UsageError("--question must not be empty")
    document = None
    if args.document is not None:
        try:
            document = load_document(args.document, max_bytes=int(args.max_mb * 1_000_000), companion_toc=True)
        except DocumentError as e:
            raise UsageError(f"{args.document}: {e}") from None
    spec = None if args.sections is None else args.sections.strip().lower()
    if spec is not None and document is None:
        raise UsageError("--sections needs --document")
    if args.reading_budget is not None and args.reading_budget < 64:
        raise UsageError(f"--reading-budget must be at least 64 tokens, got {args.reading_budget}")
    if args.truncate and spec == "auto":
        raise UsageError("--truncate and --sections auto exclude each other (auto reads what fits, whole)")
    picked = None
    if spec not in (None, "auto", "all"):
        try:
            picked = parse_spec(spec, len(document.sections))
        except SectionError as e:
            raise UsageError(f"--sections: {e}") from None
    engine, config = load_engine(args)
    if engine.tokenizer is None:
        raise UsageError("the target has no tokenizer; chat needs one")
    apply_kv_cache_args(engine, args)
    session = _chat_session(engine, document, spec, picked, config, args)
    # said once, as the app's model line says it, and after the document was found to fit (a
    # refusal stays one line)
    if not has_chat_template(engine.tokenizer):
        print(f"note: {PLAIN_LAYOUT_NOTE}", file=sys.stderr)
    colour = sys.stdout.isatty() and "NO_COLOR" not in os.environ and not args.json
    out_turns = []
    for q in args.question:
        if not args.json:
            print(f"Q: {q}\nA: ", end="", flush=True)
        detok = colour_detokenizer(engine, colour)
        events = session.ask(q)
        if session.sections_read is not None and not args.json:
            print(_read_line(session.sections_read), file=sys.stderr, flush=True)
        for ev in events:
            if args.json:
                continue
            if isinstance(ev, Committed):
                write_tokens(ev, detok)
            elif isinstance(ev, Finished):
                sys.stdout.write("\n\n")
                print(stats_line(ev.stats.as_dict()), file=sys.stderr)
            elif isinstance(ev, Prefilled):
                disk = f" ({ev.disk_tokens} from disk)" if ev.disk_tokens else ""
                print(f"[prefilled {ev.tokens} tokens, reused {ev.reused_tokens}{disk}, {ev.seconds:.2f}s]", file=sys.stderr)
        turn = session.turns[-1]
        if turn.truncation is not None:
            print(f"note: {turn.truncation.message()}", file=sys.stderr)
        item = {
            "question": turn.question,
            "answer": turn.answer,
            "token_ids": turn.token_ids,
            "levels": turn.levels,
            "stats": turn.stats.as_dict(),
        }
        if turn.truncation is not None:
            item["truncation"] = vars(turn.truncation)
        if turn.sections_read is not None:
            item["sections_read"] = turn.sections_read
        item["passages"] = turn.passages
        if turn.passages and not args.json:
            print(_passages_line(turn.passages), file=sys.stderr)
        out_turns.append(item)
    if args.json:
        doc = {"chars": len(session.document), "tokens": session.document_tokens}
        if isinstance(session, BookSession):  # the book, not what the last turn read of it
            doc = {"chars": len(session.book.text), "tokens": session.book_tokens, "sections": "auto",
                   "reading_budget": session.reading_budget}
        print(json.dumps({"document": doc, "turns": out_turns}))
    return 0


def _chat_session(engine, document, spec: str | None, picked, config, args):
    """The conversation the --sections choice asks for: the whole document (it fits, or `all`),
    the listed sections, or a book read by the sections most relevant to each question (`auto`,
    the default for a document beyond the window)."""
    from ..documents.reading import BookReader, token_starts
    from ..serving.book import DEFAULT_READING_BUDGET, BookSession
    from ..serving.session import ChatSession

    text = None
    if document is not None and spec in (None, "auto"):
        starts = token_starts(engine.tokenizer, document.text)
        fits = len(starts) + config.speculation.max_new_tokens <= engine.context_window
        if spec == "auto" or not (fits or args.truncate):
            budget = min(args.reading_budget or DEFAULT_READING_BUDGET, engine.context_window)
            reader = BookReader(document, starts, max_part_tokens=max(16, budget // 4))
            return BookSession(engine, document, reading_budget=budget, system_prompt=args.system, config=config,
                               reader=reader)
        text = document.text
    elif document is not None:
        text = document.text if picked is None else selected_text(document, picked)
        _check_fits(engine, document, text, config, None if spec == "all" else args.sections, args.truncate)
    session = ChatSession(engine, text, system_prompt=args.system, config=config, allow_truncation=args.truncate)
    session.truncation_hint = "--truncate"  # a refusal may name it: this command line has it
    return session


def _passages_line(passages: list[dict]) -> str:
    """'[most-read passages: 4.1. What is Ownership? «…» (75% of heads); ...]', or
    '[quoted passages: «…» (40% of the answer); ...]' where the mode retrieved nothing."""
    quoted = all(p.get("kind") == "quoted" for p in passages)
    return f"[{'quoted' if quoted else 'most-read'} passages: " + "; ".join(
        (f"{p['section']} " if p["section"] else "") + f"«{p['text'][:80]}» "
        f"({p['share']:.0%} of {'the answer' if quoted else 'heads'})"
        for p in passages) + "]"


def _read_line(sections: list[dict]) -> str:
    """'[read 3 sections, 15,872 tokens: 15 Understanding Ownership, 16 What is Ownership? (part 2 of 2), ...]'."""
    # text outside any section has no number, and its title already names the part ("Text from «…»")
    names = [s["title"] if s["number"] is None else f"{s['number']} {s['title']}"
             + (f" (part {s['part']})" if s["part"] else "") for s in sections]
    total = sum(s["tokens"] for s in sections)
    return f"[read {len(sections)} section{'s' if len(sections) != 1 else ''}, about {total:,} tokens: " + "; ".join(names) + "]"


def _check_fits(engine, document, text: str, config, spec: str | None, truncate: bool) -> None:
    """Refuse, before any prefill, a document (or selection) the window cannot hold, with the
    numbers and the sections to pick from."""
    window = engine.context_window
    tokens = len(engine.encode(text))
    if truncate or tokens + config.speculation.max_new_tokens <= window:
        return
    sizes = section_tokens(document, lambda t: len(engine.encode(t))) if document.sections else None
    what = "the document" if spec is None else f"the selection (sections {spec.replace(' ', '')})"
    raise UsageError(too_long_message(document, tokens, window, sizes, what, config.speculation.max_new_tokens))
