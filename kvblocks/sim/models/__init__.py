"""What is served: model presets and the memory bill (``spec.py``), layer kinds to KV groups
(``hybrid.py``), the GPU catalog (``gpus.py``)."""
