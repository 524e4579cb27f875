"""distlab.nn (to be filled by its issue)."""
