"""Scheduling policy and bookkeeping: pure Python, no tensors."""
