"""The run: its directory and life, and the in-process engine.

Config, partitions, metrics rows, summary, plots, checkpoints, resume, trackers and
export, for both engines.
"""
