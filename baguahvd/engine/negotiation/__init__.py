"""Negotiation: before anything runs, the ranks agree on what runs, in which order.

The parts: :mod:`.negotiator` (one rank's side: what it announces each cycle and what it
learns), :mod:`.bits` (the announced byte vector), :mod:`.coordinator` (rank 0 matches
requests across ranks), :mod:`.cache` (the response cache) and :mod:`.stall` (rank 0's
stall inspector).

Each cycle every rank runs the same exchange on the control plane:

1. One bitwise AND over a byte vector: bit ``s`` of the first part says "my request for
   cache slot ``s`` is pending" (or "I am not a member of its set"); the second part says
   "slot ``s`` is still valid for me"; the last byte holds two flags whose cleared bit means
   yes: "I have something to send rank 0" and "I announce the end of the job", and one that
   stays set while "I have nothing pending" (see :meth:`.negotiator.Negotiator.pause_s`). A
   slot that every rank marked pending runs from the cache without rank 0; one that some
   rank marked invalid is evicted everywhere and its requests are negotiated in full.
2. Only when some rank has something to send: a gather of
   :class:`~baguahvd.engine.notices.RankReport` to rank 0, whose
   :class:`~baguahvd.engine.negotiation.coordinator.Coordinator` answers every rank with one
   :class:`~baguahvd.engine.notices.Decision`.

Rank 0 also uses the second step to hand every rank new autotune settings
(:mod:`~baguahvd.engine.autotune`): while it holds a proposal it announces something to
send, so the exchange happens, and the decision carries the settings to every rank in the
same cycle.

Unnamed allreduces and broadcasts of the global set are cached under what they move (see
:mod:`~baguahvd.engine.negotiation.cache`), which is safe only while the bits pair the n-th
unnamed call of every rank. So a rank lets only its oldest unnamed request, with no other
unnamed request of the set pending, wait on the cache (every rank has run the same unnamed
collectives, so the oldest is the same n everywhere), and two more flag bits say whether it
has an unnamed request in the full negotiation (then ranks whose oldest waits on the cache
send it in full too: rank 0 pairs it there) and whether its oldest waits on the cache (if
every rank's does and no slot is ready, their shapes differ: all send it in full, and rank 0
answers with the mismatch error).

The cycle's agreed work is the cached hits (in slot order) followed by rank 0's responses.
Every rank then caches the same responses in the same order
(:meth:`.negotiator.Negotiator.remember`), which keeps the caches identical. While a rank
has joined, nothing is answered from the cache: cached announcements cannot count ranks that
joined.
"""
