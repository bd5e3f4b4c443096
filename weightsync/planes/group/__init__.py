"""The dedicated-group plane, both ends: what speaks torch.distributed process groups (a member's
``GroupPlane``, the publisher's ``GroupSend``) and the reaper of retired backends (private)."""
