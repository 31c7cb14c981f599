"""Evaluating trained models: held-out token losses with intervals, compute, lm-evaluation-harness."""
