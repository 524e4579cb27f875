"""distlab.autograd (to be filled by its issue)."""
