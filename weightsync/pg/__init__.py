"""The control plane, membership and generations, the dedicated-group data plane, the flight
recorder and everything that touches torch.distributed. Private: public names are re-exported
by :mod:`weightsync`."""
