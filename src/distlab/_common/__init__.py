"""Code that both twins of a component share, defined once: one module per component (never copied into core/)."""
