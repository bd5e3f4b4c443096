"""The membership protocol: who is in, generations, the trainer ranks' protocol (private)."""
