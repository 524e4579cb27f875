"""distlab.optim (to be filled by its issue)."""
