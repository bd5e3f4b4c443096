"""The encodings, between staging and the plane: the seam's types (``seam``), the registry by name,
the built-in deltas (``delta``) and their codec (``codec``). Private: plug-ins import
:mod:`weightsync.extend`."""
