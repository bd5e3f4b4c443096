"""The asyncio API users call: ``Publisher`` and ``Subscriber`` and what composes them (the door,
the plane set, the trainer ranks, the loop thread). Private: public names are re-exported by
:mod:`weightsync`."""
