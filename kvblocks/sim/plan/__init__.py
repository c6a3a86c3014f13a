"""The planner behind ``kvblocks plan``: length distributions (``lengths.py``), the replica sweep
over a trace (``capacity.py``), the GPU search (``gpuplan.py``) and its subcommand (``cli.py``)."""
