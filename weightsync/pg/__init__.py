"""What speaks torch.distributed process groups: the dedicated-group data plane (both ends) and the
reaper of retired backends. Private: public names are re-exported by :mod:`weightsync`."""
