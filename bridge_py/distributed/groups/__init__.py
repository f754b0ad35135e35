"""What runs over any group of ranks, torch's or stateless: objects between ranks, the
same-node probe, and torch process groups made without torch's global state."""
