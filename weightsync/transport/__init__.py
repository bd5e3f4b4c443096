"""The asyncio API users call (Publisher, Subscriber, handles) and the two ends' threads behind it
(Sender, Receiver, snapshots, trainer ranks, staging, slots). Private: public names are
re-exported by :mod:`weightsync`."""
