"""The serving wing: one engine for many callers.

The scheduler (`worker`), the models a server offers (`registry`), chat sessions over a
document or a book (`session`, its turn records in `turns`, `book`), prefix-matched cache slots
(`slots`), the OpenAI-compatible HTTP API (`openai`: schemas, routes, streaming) and its
Prometheus metrics (`metrics`), the same API from Ray Serve replicas (`cluster`, routed by
`routing`'s content key), and a served engine used from another process (`remote`, over the
wire formats of `event_wire` and `tokenizer_wire`). May import documents, the engine and every wing below; never the
command line or the app.
"""
