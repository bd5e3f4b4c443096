"""The same-host shared-memory plane, both ends: the publisher's memfd segments and its part, a
member's ``ShmPlane`` (private)."""
