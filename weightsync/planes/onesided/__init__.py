"""The one-sided plane, both ends: members read each bucket out of the publisher's registered
staging memory over ``torch.distributed._transport`` (torch 2.15, NIXL), the publisher's part
registers and announces it (private)."""
