"""The control plane: each member's own authenticated TCP connection to its publisher.

Private; see :mod:`weightsync.control.server` (the publisher's end), :mod:`.client` (a
subscriber's), :mod:`.framing` (frames, sequence numbers, MACs), :mod:`.auth` (admission),
:mod:`.rendezvous` (the data plane's store, served by the publisher from memory) and
:mod:`.refusals` (refused connections, counted in the flight recorder).
"""
