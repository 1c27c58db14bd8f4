"""The trace side of a tap: what it becomes in a computation (the primitive, its rules, the
lowerings, the transports)."""
