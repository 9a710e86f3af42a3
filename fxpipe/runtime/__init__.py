"""Execution: stage runners, the schedule executor, process groups and p2p."""
