"""The engine: one background thread per process that negotiates, fuses and runs collectives.

Its parts, each importing only those listed after it (import-linter checks the order):

1. :mod:`.engine`: the :class:`~.engine.Engine` user threads submit to, and its lifecycle
   calls (start, shutdown, fail);
2. :mod:`.loop`: the engine thread, one cycle after another;
3. :mod:`.intake` (the request queue), :mod:`.negotiation` (what every rank agrees to run),
   :mod:`.execution` (fusion, dispatch, arithmetic, completion) and :mod:`.lifecycle` (state
   machine, watchdog), which do not import each other;
4. :mod:`.submission`: what a user thread works out about a call before queueing it (its
   name, its tensors' description, its place in the CUDA stream);
5. :mod:`.requests` (requests, handles, outcomes), :mod:`.notices` (how a job's end is
   told) and :mod:`.process_sets` (the registry);
6. :mod:`.timeline`, :mod:`.autotune` and :mod:`.buffers` (fusion buffers);
7. :mod:`.messages`: what ranks tell each other, and the names of ops and dtypes.
"""
