"""Serving one engine to many callers: the scheduler (`worker`), and the OpenAI-compatible HTTP
API (`openai_api`) over a pool of prefix-matched caches (`triforce_core.slots`)."""
