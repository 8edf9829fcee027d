"""KV-aware routing: block hashing shared by workers and routers, and the router's event formats
(`RouterEvent` on `kv-events`, `ActiveLoad` on `kv_metrics`)."""
