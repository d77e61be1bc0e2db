"""KV-cache transfer between workers: wire format, sender/receiver state machines, transports."""
