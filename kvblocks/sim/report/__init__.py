"""Reports: the simulation report (text and JSON), per-group lines, number formats, plots."""
