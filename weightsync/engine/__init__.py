"""The engine that drives a version: the Sender and the Receiver (a version's order) and what they
own and ask: staging and snapshots, slots, where a version lands, seals, retries, the ``"all"``
commit, reports, handles. Private: public names are re-exported by :mod:`weightsync`."""
