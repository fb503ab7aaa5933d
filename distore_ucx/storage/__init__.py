"""Storage node: one registered arena, slots written on insert, read one-sided."""
