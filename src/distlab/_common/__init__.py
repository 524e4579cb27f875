"""Code each twinned component shares between its two twins (one module per component)."""
