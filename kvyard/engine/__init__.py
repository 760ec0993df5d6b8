"""The single-replica inference engine."""
