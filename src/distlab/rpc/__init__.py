"""distlab.rpc (to be filled by its issue)."""
