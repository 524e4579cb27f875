"""Code shared by the two twins of each component (one module per component), imported by both, never copied."""
