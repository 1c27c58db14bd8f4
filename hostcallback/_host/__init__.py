"""The host side of a tap: what happens to a record once it left its queue (the receivers, the
consumers' calls, their failures)."""
