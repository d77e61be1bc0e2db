"""Adaptive worker: one engine that prefills for other workers and decodes, so the router can
switch its role at run time (``mode: adaptive``)."""
