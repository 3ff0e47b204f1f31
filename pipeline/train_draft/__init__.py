"""`python -m jobs.train_draft`: distil a small Llama-style draft for any target on the target's own completions."""
