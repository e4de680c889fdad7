"""Maintenance scripts for the embedded demo models and the sample document (not installed).

Run them as modules from the repository root, e.g. `python -m scripts.train_demo_models`;
`make demo-models` and `make eval-demo-models` do.
"""
