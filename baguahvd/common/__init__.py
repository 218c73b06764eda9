"""Framework-independent pieces: configuration, errors, process sets, the runtime."""
