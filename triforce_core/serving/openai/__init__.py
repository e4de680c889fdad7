"""An OpenAI-compatible HTTP API over the serving wing: requests validated (`schemas`),
generations turned into completions and server-sent events (`streaming`), the endpoints
(`routes`). May import serving's siblings, documents, the engine and every wing below.
"""

from .routes import ChatCompletionsAPI, create_app, run_server
from .schemas import ApiError, CompletionRequest, parse_request

__all__ = ["ApiError", "ChatCompletionsAPI", "CompletionRequest", "create_app", "parse_request", "run_server"]
