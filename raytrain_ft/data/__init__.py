"""Dataset preparation, deterministic sample order and the world-size-independent data position."""
