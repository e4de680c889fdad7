"""Chat messages to the prompt a target answers: its chat template, or a plain transcript.

    text, ids = render_prompt(tokenizer, [{"role": "user", "content": "..."}])
    stops = answer_stops(tokenizer)   # ("\nQuestion:",) for the plain layout, () with a chat template

One rendering for chat sessions, the `chat` endpoint and the HTTP API, so the same
conversation gives the same token ids wherever it comes from (and their caches match).
"""

from __future__ import annotations

ROLES = ("system", "user", "assistant")
# Where an answer in the plain layout ends: a base model left alone writes the next question
# itself; the answer is cut before it (`decoding.stop_text`).
PLAIN_STOPS = ("\nQuestion:",)
# What the app's model line and the `chat` command say of a model without a chat template (a
# base model such as Gemma 3 270M): how its prompt is laid out and where its answer ends.
PLAIN_LAYOUT_NOTE = ("base model: no chat template — the document, your question and the answer are laid out "
                     "as plain text (Question: … Answer: …), and the answer ends where the model begins a "
                     "question of its own")


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def answer_stops(tokenizer) -> tuple[str, ...]:
    """The texts that end an answer to a `render_prompt` prompt: none where the chat template
    closes the turn (its end-of-turn token is an end-of-sequence id), the next "Question:" in
    the plain layout."""
    return () if has_chat_template(tokenizer) else PLAIN_STOPS


def render_prompt(tokenizer, messages: list[dict]) -> tuple[str, list[int]]:
    """(text, token ids) of `messages` followed by the start of the assistant's answer.

    With a chat template the rendered text already holds the special tokens, so none are added
    when tokenizing; a model without one gets "Question: ... Answer:" turns after its usual
    special tokens (e.g. BOS). An earlier answer follows "Answer: " without the space it began
    with (a model's answer after "Answer:" begins with its own), so the conversation reads as the
    model wrote it and its tokens match those the model committed.
    """
    if has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])
    parts = []
    for m in messages:
        if m["role"] == "system":
            parts.append(m["content"] + "\n\n")
        elif m["role"] == "user":
            parts.append(f"Question: {m['content']}\n")
        else:
            parts.append(f"Answer: {m['content'].lstrip()}\n\n")
    parts.append("Answer:")
    text = "".join(parts)
    return text, list(tokenizer(text)["input_ids"])
