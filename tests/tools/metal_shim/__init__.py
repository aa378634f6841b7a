"""Metal shim, kernel translator and threadgroup emulator (test infrastructure)."""
