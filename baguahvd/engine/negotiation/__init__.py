"""Negotiation: before anything runs, the ranks agree on what runs, in which order.

The parts: :mod:`.negotiator` (one rank's side: what it announces each cycle and what it
learns), :mod:`.bits` (the announced byte vector), :mod:`.tree` (how the reports reach rank
0) and :mod:`.tally` (what they merge into on the way), :mod:`.coordinator` (rank 0 matches
requests across ranks), :mod:`.cache` (the response cache), :mod:`.window` (the unnamed
requests that wait on the cache) and :mod:`.stall` (rank 0's stall inspector).

Each cycle every rank runs the same exchange on the control plane:

1. One bitwise AND over a byte vector: bit ``s`` of the first part says "my request for
   cache slot ``s`` is pending" (or "I am not a member of its set"); the second part says
   "slot ``s`` is still valid for me"; the last byte holds flags whose cleared bit means
   yes, among them "I have something to send rank 0" and "I announce the end of the job". A
   slot that every rank marked pending runs from the cache without rank 0; one that some
   rank marked invalid is evicted everywhere and its requests are negotiated in full.
2. Only when some rank has something to send: every rank's
   :class:`~baguahvd.engine.notices.RankReport` goes to rank 0, merged on the way up a
   binomial tree into one :class:`~baguahvd.engine.negotiation.tally.Tally` (each distinct
   request once, with the ranks that sent it; small jobs gather the reports instead, see
   :mod:`.tree`), and rank 0's
   :class:`~baguahvd.engine.negotiation.coordinator.Coordinator` answers every rank with one
   :class:`~baguahvd.engine.notices.Decision` (a broadcast).

Rank 0 also uses the second step to hand every rank new autotune settings
(:mod:`~baguahvd.engine.autotune`): while it holds a proposal it announces something to
send, so the exchange happens, and the decision carries the settings to every rank in the
same cycle.

Unnamed allreduces and broadcasts of the global set are cached under what they move and
their position (see :mod:`~baguahvd.engine.negotiation.cache`): the request ``noname.N`` is
looked up at position ``N - B``, where ``B`` is the number of the oldest unnamed collective
not yet agreed, the same on every rank between cycles. So the same position names the same
collective on every rank, and a burst of unnamed calls that recurs (a loop of
``allreduce_async_``) runs from the cache, one entry per position. A rank's unnamed requests
wait on the cache oldest first (:attr:`~.negotiator.Negotiator.unnamed_window`); a cycle
runs the longest run of them, from the oldest, whose slots every rank announced (every rank
finds the same run), so they still run in order. Two more flag bits say whether a rank has
an unnamed request in the full negotiation (then every rank sends its waiting ones in full:
rank 0 pairs them by name) and whether its oldest waits on the cache (if every rank's does
and none ran, their requests differ: all send them in full, and rank 0 answers with the
mismatch error). A rank whose oldest unnamed request misses the cache sends all of them in
full, and later ones follow in full until those are agreed.

The cycle's agreed work is the cached hits (in slot order) followed by rank 0's responses.
Before any of it runs, every rank caches the same responses in the same order
(:meth:`.negotiator.Negotiator.file_responses`), which keeps the caches identical; the
entries of a set that the cycle removes are evicted first and its responses are not cached,
as its removal will evict them. While a rank has joined, nothing is answered from the
cache: cached announcements cannot count ranks that joined.
"""
