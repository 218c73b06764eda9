"""``horovod.runner.util.threads``: baguahvd's thread helpers under Horovod's name."""

from baguahvd.compat.runner_threads import execute_function_multithreaded, in_thread, on_event

__all__ = ["execute_function_multithreaded", "in_thread", "on_event"]
