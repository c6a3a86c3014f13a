"""The host tier in the simulator: its size and manager flags (``host.py``) and the order a step
drains its copy lists in (``drain.py``)."""
