"""Execution: what runs the agreed collectives on this rank.

:mod:`.fusion` plans which agreed allreduces share a buffer (a pure function of the agreed
responses, the same on every rank); :mod:`.dispatch` runs each unit on its process set's
communicator and hands every request's outcome to its handle; :mod:`.execute` holds the
tensor arithmetic of each collective; :mod:`.completion` completes the device units that were
launched without waiting.
"""
