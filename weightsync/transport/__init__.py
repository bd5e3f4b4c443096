"""The asyncio API (Publisher, Subscriber, handles) and the composed Sender and Receiver that
drive a data plane through one interface (:mod:`weightsync.transport.dataplane`). Private:
public names are re-exported by :mod:`weightsync`."""
