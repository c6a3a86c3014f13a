"""Workloads: requests and trace loaders (``traces.py``), deterministic token streams
(``tokens.py``), the built-in workload's generator (``builtin.py``)."""
