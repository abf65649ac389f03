"""Speculative decode steps (baseline, MTP, DSpark/DFlash) and the shared verifier."""
