"""Transports: thin loops that move envelopes between a client and the dispatcher."""
