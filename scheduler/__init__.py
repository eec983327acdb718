"""Scheduling policy and bookkeeping: Python and host numpy (a step's planning arithmetic), no model code."""
