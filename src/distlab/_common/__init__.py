"""Code each twinned component shares between its reference and core twins (one module per component)."""
