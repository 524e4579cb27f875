"""Code that both twins of a component share, one module (or a few ``<component>_*`` modules) per component."""
