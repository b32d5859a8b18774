"""Sampling: from the last position's logits to the next token (sampler.py), and the rejection
sampler that keeps or drops speculative drafts (rejection_sampler.py). Data path, like vLLM's
v1/sample."""
