"""Chat messages to the prompt a target answers: its chat template, or a plain transcript.

    text, ids = render_prompt(tokenizer, [{"role": "user", "content": "..."}])

One rendering for chat sessions, the `chat` endpoint and the HTTP API, so the same
conversation gives the same token ids wherever it comes from (and their caches match).
"""

from __future__ import annotations

ROLES = ("system", "user", "assistant")


def render_prompt(tokenizer, messages: list[dict]) -> tuple[str, list[int]]:
    """(text, token ids) of `messages` followed by the start of the assistant's answer.

    With a chat template the rendered text already holds the special tokens, so none are added
    when tokenizing; a model without one gets "Question: ... Answer:" turns after its usual
    special tokens (e.g. BOS).
    """
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text, list(tokenizer(text, add_special_tokens=False)["input_ids"])
    parts = []
    for m in messages:
        if m["role"] == "system":
            parts.append(m["content"] + "\n\n")
        elif m["role"] == "user":
            parts.append(f"Question: {m['content']}\n")
        else:
            parts.append(f"Answer: {m['content']}\n\n")
    parts.append("Answer:")
    text = "".join(parts)
    return text, list(tokenizer(text)["input_ids"])
