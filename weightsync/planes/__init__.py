"""The data planes: the interface, the send side, the encoding seam, the same-host plane (private)."""
