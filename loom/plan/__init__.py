"""The planner: predicted memory, communication and step time. Pure Python: no torch import."""
