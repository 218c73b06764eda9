"""Lifecycle: the states between start and exit, and every way out.

:mod:`.states` holds the one state enum, its transition table and the stop, alarm and exit
logic; :mod:`.watchdog` notices peers that died or froze.
"""
