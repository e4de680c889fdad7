"""The app's event handlers, one module per feature: `documents` (upload and the sample),
`answers` (ask, regenerate, compare, stop, clear, the teaching view) and `chat_endpoint`
(the named `chat` API endpoint). Each takes the shared `ui.state.AppContext`."""
