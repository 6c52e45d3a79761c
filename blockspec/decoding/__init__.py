"""Decoding: the one step (draft -> verify -> accept -> commit), the verifier for chains and trees,
the target's caches and their rollback, the adaptive width policy, and the drivers of the step
(one sequence's stream, the batch engine, one-at-a-time serving, text in and out)."""
