"""The engine: one background thread per process that negotiates, fuses and runs collectives."""
