"""The engine: the paged replay (one continuous-batching engine over a BlockManager), its step
budget and limits, the roofline time model and its calibration, the recorder, and the contiguous
baseline replayed in the same shape."""
