"""The speed-up-by-context plot of the README from bench/results/chat-by-context-{16,32,64}k.json.

    python -m bench.plot_by_context     # -> bench/results/chat_speedup_by_context.png
"""

from __future__ import annotations

import json
import plotly.graph_objects as go
names = {"triforce": "TriForce (lookup, then retrieval)", "triforce-paper": "the paper's three levels",
         "retrieval-paper": "retrieval alone", "lookup": "lookup alone (the default)"}
xs, series = [], {k: [] for k in names}
for n in (16, 32, 64):
    d = json.load(open(f"bench/results/chat-by-context-{n}k.json"))
    xs.append(d["document_tokens"])
    ar = d["results"]["autoregressive"]["tokens_per_s"]
    for k in names:
        series[k].append(d["results"][k]["tokens_per_s"] / ar)
fig = go.Figure(layout=dict(template="plotly_white", width=760, height=420,
                            title="Document chat: decode speed-up over autoregressive, by context (demo pair, 2 CPU cores)"))
for k, label in names.items():
    fig.add_trace(go.Scatter(x=xs, y=series[k], mode="lines+markers", name=label))
fig.add_hline(y=1.0, line_dash="dot", annotation_text="autoregressive")
fig.update_xaxes(title="document tokens", type="log", tickvals=xs)
fig.update_yaxes(title="speed-up (×)")
fig.write_image("bench/results/chat_speedup_by_context.png")
print("bench/results/chat_speedup_by_context.png")
