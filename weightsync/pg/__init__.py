"""What speaks torch.distributed: membership and generations, the dedicated-group data plane,
the flight recorder and torch compatibility. Private: public names are re-exported by
:mod:`weightsync`."""
