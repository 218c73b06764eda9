"""What ``init()`` builds and wires: topology, control plane, engine, handle table."""

from baguahvd.runtime.process_sets import ProcessSet, global_process_set
from baguahvd.runtime.runtime import Runtime, runtime

__all__ = ["ProcessSet", "Runtime", "global_process_set", "runtime"]
