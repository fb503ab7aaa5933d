"""Control plane: tables, samplers, removers, leases and node membership."""
