"""The data planes: the interface and the send side (this folder), then one folder per plane with
both of its ends: ``group`` (gloo/NCCL, point to point for sliced members), ``shm`` (same host)."""
