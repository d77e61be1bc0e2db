"""Router: picks a prefill and a decode worker per request and streams tokens back; no model code."""
